//! Build a model from a config, run a forward pass and the loss, save the weights with Burn's
//! own file format, load them into a fresh model, and check it computes the same logits.
//!
//! ```text
//! cargo run --release -p ember-model --example forward
//! ```

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor};
use ember_model::{DecoderOnlyConfig, PositionalKind};

fn main() {
    let device = Device::flex();
    let config = DecoderOnlyConfig {
        vocab_size: 100,
        d_model: 64,
        n_heads: 4,
        n_layers: 2,
        context_len: 32,
        positional: PositionalKind::Rotary,
        ..Default::default()
    };
    let model = config.init(&device).expect("a valid config");
    println!("{}", model.summary());

    // Two sequences of 8 tokens; targets are the inputs shifted by one.
    let tokens = Tensor::<2, Int>::from_ints(
        [[1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7, 6, 5, 4, 3, 2]],
        &device,
    );
    let targets = Tensor::<2, Int>::from_ints(
        [[2, 3, 4, 5, 6, 7, 8, 9], [8, 7, 6, 5, 4, 3, 2, 1]],
        &device,
    );
    let logits = model.forward(tokens.clone()); // [B, T, V] = [2, 8, 100]
    println!("logits {:?}", logits.dims());
    let loss = model.loss(tokens.clone(), targets).into_scalar::<f32>();
    println!(
        "loss {loss:.4} (ln 100 = {:.4} for a uniform guess)",
        (100f32).ln()
    );

    // Save with Burn's recorder and load into a model with other (random) weights.
    let path = std::env::temp_dir().join(format!("ember-example-{}.bpk", std::process::id()));
    model.clone().save_file(&path).expect("the weights save");
    let fresh = config.init(&device).expect("a valid config");
    let loaded = fresh.try_load_file(&path).expect("the weights load");
    let again = loaded.forward(tokens);
    let diff = (logits - again).abs().max().into_scalar::<f32>();
    println!(
        "saved to {} and loaded back: largest logit difference {diff}",
        path.display()
    );
    assert_eq!(diff, 0.0);
    let _ = std::fs::remove_file(path);
}
