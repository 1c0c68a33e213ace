//! ember-infer
