//! Where each tensor of ember's decoder-only model sits in a GPT-NeoX file: its name, its shape
//! there, and how its values move between the layouts (see [`super::neox`]).

use ember_model::DecoderOnlyConfig;

use super::tensors::Array;

/// How a tensor's values move between the two layouts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Move {
    /// As they are.
    Same,
    /// A linear layer's weight: `[out, in]` in GPT-NeoX, `[in, out]` in ember.
    Transposed,
    /// The fused projection's weight: transposed, and its outputs regrouped by head.
    QkvWeight,
    /// The fused projection's bias: regrouped by head.
    QkvBias,
}

/// One tensor of the model under both names, its GPT-NeoX shape and how its values move.
#[derive(Debug, Clone)]
pub(super) struct Entry {
    pub ember: String,
    pub neox: String,
    pub shape: Vec<usize>,
    pub how: Move,
}

/// Every tensor of the model `config` describes (GPT-NeoX holds all the biases).
pub(super) fn entries(config: &DecoderOnlyConfig) -> Vec<Entry> {
    let (d, f, v) = (config.d_model, config.d_ff(), config.vocab_size);
    let entry = |ember: String, neox: String, shape: &[usize], how| Entry {
        ember,
        neox,
        shape: shape.to_vec(),
        how,
    };
    let mut all = vec![entry(
        "wte.weight".into(),
        "gpt_neox.embed_in.weight".into(),
        &[v, d],
        Move::Same,
    )];
    for i in 0..config.n_layers {
        let (e, n) = (format!("blocks.{i}."), format!("gpt_neox.layers.{i}."));
        for (ours, theirs) in [
            ("ln_1", "input_layernorm"),
            ("ln_2", "post_attention_layernorm"),
        ] {
            for (gamma, weight) in [("gamma", "weight"), ("beta", "bias")] {
                all.push(entry(
                    format!("{e}{ours}.norm.{gamma}"),
                    format!("{n}{theirs}.{weight}"),
                    &[d],
                    Move::Same,
                ));
            }
        }
        let linears = [
            ("attn.c_attn", "attention.query_key_value", d, 3 * d),
            ("attn.c_proj", "attention.dense", d, d),
            ("mlp.c_fc", "mlp.dense_h_to_4h", d, f),
            ("mlp.c_proj", "mlp.dense_4h_to_h", f, d),
        ];
        for (ours, theirs, inputs, outputs) in linears {
            let qkv = ours == "attn.c_attn";
            let (weight, bias) = match qkv {
                true => (Move::QkvWeight, Move::QkvBias),
                false => (Move::Transposed, Move::Same),
            };
            all.push(entry(
                format!("{e}{ours}.weight"),
                format!("{n}{theirs}.weight"),
                &[outputs, inputs],
                weight,
            ));
            all.push(entry(
                format!("{e}{ours}.bias"),
                format!("{n}{theirs}.bias"),
                &[outputs],
                bias,
            ));
        }
    }
    all.push(entry(
        "ln_f.gamma".into(),
        "gpt_neox.final_layer_norm.weight".into(),
        &[d],
        Move::Same,
    ));
    all.push(entry(
        "ln_f.beta".into(),
        "gpt_neox.final_layer_norm.bias".into(),
        &[d],
        Move::Same,
    ));
    if !config.tie_weights {
        all.push(entry(
            "lm_head.weight".into(),
            "embed_out.weight".into(),
            &[v, d],
            Move::Transposed,
        ));
    }
    all
}

/// The fused projection's output `r` in GPT-NeoX's order (head, then q/k/v, then the head's
/// dimension) is ember's output (q/k/v, then head, then dimension) of this index.
fn ember_output(r: usize, d_model: usize, n_heads: usize) -> usize {
    let head_size = d_model / n_heads;
    let (head, rest) = (r / (3 * head_size), r % (3 * head_size));
    let (which, e) = (rest / head_size, rest % head_size);
    which * d_model + head * head_size + e
}

/// The inverse of [`ember_output`].
fn neox_output(c: usize, d_model: usize, n_heads: usize) -> usize {
    let head_size = d_model / n_heads;
    let (which, rest) = (c / d_model, c % d_model);
    let (head, e) = (rest / head_size, rest % head_size);
    head * 3 * head_size + which * head_size + e
}

/// `ember`'s tensor in GPT-NeoX's layout.
pub(super) fn to_neox(array: &Array, how: Move, config: &DecoderOnlyConfig) -> Array {
    let (d, h) = (config.d_model, config.n_heads);
    match how {
        Move::Same => array.clone(),
        Move::Transposed => array.transposed(),
        Move::QkvWeight => array.transposed().rows_from(|r| ember_output(r, d, h)),
        Move::QkvBias => array.rows_from(|r| ember_output(r, d, h)),
    }
}

/// A GPT-NeoX tensor in ember's layout.
pub(super) fn from_neox(array: &Array, how: Move, config: &DecoderOnlyConfig) -> Array {
    let (d, h) = (config.d_model, config.n_heads);
    match how {
        Move::Same => array.clone(),
        Move::Transposed => array.transposed(),
        Move::QkvWeight => array.rows_from(|c| neox_output(c, d, h)).transposed(),
        Move::QkvBias => array.rows_from(|c| neox_output(c, d, h)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fused_projection_regroups_by_head_and_back() {
        // d_model 6, 2 heads of 3: ember [q0 q1 | k0 k1 | v0 v1], GPT-NeoX [q0 k0 v0 | q1 k1 v1].
        let neox: Vec<usize> = (0..18).map(|r| ember_output(r, 6, 2)).collect();
        assert_eq!(
            neox,
            [0, 1, 2, 6, 7, 8, 12, 13, 14, 3, 4, 5, 9, 10, 11, 15, 16, 17]
        );
        for c in 0..18 {
            assert_eq!(ember_output(neox_output(c, 6, 2), 6, 2), c);
        }
        let config = DecoderOnlyConfig {
            d_model: 6,
            n_heads: 2,
            ..Default::default()
        };
        let weight = Array {
            shape: vec![6, 18],
            values: (0..108).map(|v| v as f32).collect(),
        };
        let theirs = to_neox(&weight, Move::QkvWeight, &config);
        assert_eq!(theirs.shape, [18, 6]);
        // GPT-NeoX's output 3 (head 0's first key) is ember's output 6, whose weights from
        // input i sit at [i, 6].
        let column: Vec<f32> = (0..6).map(|i| weight.values[i * 18 + 6]).collect();
        assert_eq!(&theirs.values[3 * 6..4 * 6], column.as_slice());
        assert_eq!(from_neox(&theirs, Move::QkvWeight, &config), weight);
        let bias = Array {
            shape: vec![18],
            values: (0..18).map(|v| v as f32).collect(),
        };
        let moved = to_neox(&bias, Move::QkvBias, &config);
        assert_eq!(moved.values[3], 6.0);
        assert_eq!(from_neox(&moved, Move::QkvBias, &config), bias);
    }
}
