//! ember-train
