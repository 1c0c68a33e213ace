//! Attention weights of a forward pass, collected per layer and head for pictures: the very
//! tensors the model used, not a recomputation.

use burn::tensor::{Device, Int, Tensor};
use ember_model::{DecoderOnly, EncoderDecoder};

/// One attention matrix: row `i` is how query token `i` spreads its attention over the keys.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionMap {
    /// Layer index (0-based).
    pub layer: usize,
    /// Head index (0-based); `None` for the mean over heads.
    pub head: Option<usize>,
    /// `[queries][keys]`, rows sum to 1.
    pub weights: Vec<Vec<f32>>,
}

/// `[B=1, H, T, S]` weights into one map per head.
fn per_head(layer: usize, weights: Tensor<4>) -> Vec<AttentionMap> {
    let [_, h, t, s] = weights.dims();
    let flat = weights.try_into_vec_as::<f32>().expect("weights are f32");
    (0..h)
        .map(|head| AttentionMap {
            layer,
            head: Some(head),
            weights: (0..t)
                .map(|i| flat[(head * t + i) * s..(head * t + i + 1) * s].to_vec())
                .collect(),
        })
        .collect()
}

fn ids_tensor(ids: &[u32], device: &Device) -> Tensor<2, Int> {
    let v: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
    Tensor::<1, Int>::from_ints(v.as_slice(), device).reshape([1, ids.len()])
}

/// Self-attention maps of every layer and head of a language model on `ids` (`layers * heads`
/// maps, layer-major).
pub fn self_attention(model: &DecoderOnly, ids: &[u32]) -> Vec<AttentionMap> {
    let device = model.wte.weight.device();
    let out = model.forward_with(ids_tensor(ids, &device), None, None, true);
    out.weights
        .into_iter()
        .enumerate()
        .flat_map(|(layer, w)| per_head(layer, w.self_attn.expect("weights were asked for")))
        .collect()
}

/// Cross-attention maps (target rows over source columns) of every decoder layer and head, for
/// `src` (ending with EOS) and the decoder input `tgt_in` (BOS + target tokens).
pub fn cross_attention(model: &EncoderDecoder, src: &[u32], tgt_in: &[u32]) -> Vec<AttentionMap> {
    let device = model.src_embed.weight.device();
    let memory = model.encode(ids_tensor(src, &device), None);
    let out = model.decode(ids_tensor(tgt_in, &device), None, &memory, None, true);
    out.weights
        .into_iter()
        .enumerate()
        .flat_map(|(layer, w)| per_head(layer, w.cross_attn.expect("weights were asked for")))
        .collect()
}

/// The mean over heads of each layer's maps.
pub fn mean_over_heads(maps: &[AttentionMap]) -> Vec<AttentionMap> {
    let layers = maps.iter().map(|m| m.layer + 1).max().unwrap_or(0);
    (0..layers)
        .map(|layer| {
            let heads: Vec<&AttentionMap> = maps.iter().filter(|m| m.layer == layer).collect();
            let (t, s) = (heads[0].weights.len(), heads[0].weights[0].len());
            let weights = (0..t)
                .map(|i| {
                    (0..s)
                        .map(|j| {
                            heads.iter().map(|m| m.weights[i][j]).sum::<f32>() / heads.len() as f32
                        })
                        .collect()
                })
                .collect();
            AttentionMap {
                layer,
                head: None,
                weights,
            }
        })
        .collect()
}
