//! Sample from a decoder-only model with the KV cache, using only `ember-model` and Burn: each
//! step feeds one new token and reuses the keys and values of the earlier ones.
//!
//! ```text
//! # a checkpoint written by `ember train` (char tokenizer), e.g. the default run:
//! cargo run --release -p ember-model --example generate -- runs/small "ROMEO:"
//! # no checkpoint: a random model (gibberish, but the same code path)
//! cargo run --release -p ember-model --example generate
//! ```

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor};
use ember_model::{DecoderOnly, DecoderOnlyConfig};

/// A model and its characters (id `i` is `chars[i]`; id `chars.len()` is unknown).
fn load(dir: &Path, device: &Device) -> (DecoderOnly, Vec<char>) {
    // A run folder names its newest checkpoint in `latest`.
    let dir = match std::fs::read_to_string(dir.join("latest")) {
        Ok(latest) => dir.join(latest.trim()),
        Err(_) => dir.to_path_buf(),
    };
    let config: toml::Table = std::fs::read_to_string(dir.join("config.toml"))
        .expect("config.toml")
        .parse()
        .expect("TOML");
    let config: DecoderOnlyConfig = config["model"]
        .clone()
        .try_into()
        .expect("a [model] section");
    let vocab: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("chars.json")).expect("chars.json"))
            .expect("JSON");
    let chars = vocab["chars"].as_str().expect("chars").chars().collect();
    let model = config.init(device).expect("a valid config");
    let model = model
        .try_load_file(dir.join("model.bpk"))
        .expect("model.bpk loads");
    println!("loaded {}", dir.display());
    (model, chars)
}

fn random_model(device: &Device) -> (DecoderOnly, Vec<char>) {
    let chars: Vec<char> = " abcdefghijklmnopqrstuvwxyzROMEO:\n".chars().collect();
    let config = DecoderOnlyConfig {
        vocab_size: chars.len() + 1,
        d_model: 32,
        n_heads: 2,
        n_layers: 2,
        context_len: 64,
        ..Default::default()
    };
    (config.init(device).expect("a valid config"), chars)
}

/// The most likely next token after the last position of `logits` `[1, T, V]`.
fn argmax_last(logits: Tensor<3>) -> u32 {
    let [_, t, v] = logits.dims();
    let last = logits.slice([0..1, t - 1..t, 0..v]).reshape([v]);
    last.argmax(0).into_scalar::<i64>() as u32
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let device = Device::flex();
    let (model, chars) = match args.first() {
        Some(dir) => load(&PathBuf::from(dir), &device),
        None => random_model(&device),
    };
    let prompt = args.get(1).map_or("ROMEO:", String::as_str);
    let unknown = chars.len() as u32;
    let ids: Vec<i64> = prompt
        .chars()
        .map(|c| {
            chars
                .iter()
                .position(|&x| x == c)
                .map_or(unknown, |i| i as u32) as i64
        })
        .collect();

    // The prompt in one pass fills the cache; then one token per step.
    let mut cache = model.new_cache();
    let prompt_tokens =
        Tensor::<1, Int>::from_ints(ids.as_slice(), &device).reshape([1, ids.len()]);
    let mut logits = model
        .forward_with(prompt_tokens, None, Some(&mut cache), false)
        .logits;
    let room = model.max_positions - ids.len();
    let mut text = prompt.to_string();
    for _ in 0..room.min(200) {
        let next = argmax_last(logits);
        text.push(chars.get(next as usize).copied().unwrap_or('\u{FFFD}'));
        let token = Tensor::<2, Int>::from_ints([[next as i64]], &device);
        logits = model
            .forward_with(token, None, Some(&mut cache), false)
            .logits;
    }
    println!("{text}");
}
