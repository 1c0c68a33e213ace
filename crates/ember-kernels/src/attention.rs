//! Two attention ops: causal self-attention from the fused `[Q | K | V]` projection (training
//! and a prompt's first pass), and the attention of one query over a KV cache (each decoding
//! step).
//!
//! Kernels (flex `f32`): [`crate::flex::attention`] runs every head of every sequence as
//! one task that reads its columns where the projection wrote them, with its own backward
//! pass; [`crate::flex::decode_attention`] loops over the cached keys in place instead of
//! two one-row matrix multiplies (plain tensors only: decoding is never differentiated).

use burn::nn::{Dropout, Linear};
use burn::tensor::activation::softmax;
use burn::tensor::{Bool, DType, Device, FloatDType, Int, Tensor};

use super::causal_softmax_reference;
use crate::masks::MASKED_SCORE;

/// `dropout(softmax(Q K^T / sqrt(K) + causal mask)) V` per head, heads merged, from the fused
/// projection (no padding); `qkv` back when `dropout` is active (training) and no kernel here
/// applies it, for the caller's general path (in f32). A bf16 (or f16) `qkv`, mixed precision's
/// projection, gives its output in its own type.
///
/// # Shapes
/// - qkv: `[B, T, 3D]`, columns `[Q | K | V]`, head `h` at columns `h*K..(h+1)*K` of each
/// - output: `[B, T, D]`
pub fn causal_self_attention(
    qkv: Tensor<3>,
    heads: usize,
    dropout: &Dropout,
) -> Result<Tensor<3>, Tensor<3>> {
    let drop = applied(dropout, &qkv.device());
    #[cfg(feature = "cube")]
    let qkv = match super::cube::attention::causal_self_attention(qkv, heads, drop) {
        Ok(context) => return Ok(context),
        Err(qkv) => qkv,
    };
    let dtype = qkv.dtype();
    if dtype != DType::F32 {
        // Mixed precision's bf16 projection where no kernel keeps it narrow: computed in f32,
        // the output given back in the projection's type.
        let context = causal_self_attention(qkv.cast(FloatDType::F32), heads, dropout)?;
        return Ok(context.cast(FloatDType::from(dtype)));
    }
    #[cfg(feature = "flex")]
    let qkv = match flex_attention(qkv, heads, drop) {
        Ok(context) => return Ok(context),
        Err(qkv) => qkv,
    };
    if drop > 0.0 {
        return Err(qkv);
    }
    Ok(causal_self_attention_reference(qkv, heads))
}

/// [`causal_self_attention`] by the flex kernel, with dropout's mask where `drop` is above 0
/// (drawn only where the kernel takes `qkv`); `qkv` back where it does not apply.
#[cfg(feature = "flex")]
fn flex_attention(qkv: Tensor<3>, heads: usize, drop: f64) -> Result<Tensor<3>, Tensor<3>> {
    let mask = match drop > 0.0 {
        false => None,
        true if drop < 1.0 && super::flex::tensor::is_flex_f32(&qkv) => {
            Some(super::dropout::drawn_mask(&qkv.device(), drop as f32))
        }
        true => return Err(qkv),
    };
    super::flex::attention::causal_self_attention(qkv, heads, mask)
}

/// The training attention of `x` on itself under the causal mask alone, from the block's input
/// to its output projection, as one op where a kernel takes it: the `[Q | K | V]` projection by
/// `c_attn` (left in mixed precision's product type where it is not rotated, as the kernels
/// read it), the queries and keys rotated at positions `0..` by `rope` where there is one,
/// [`causal_self_attention`] with `dropout` on the weights, and the projection by `c_proj`,
/// given back in `x`'s type. `Err` is the projection, rotated, in `x`'s type, for the caller's
/// own path (see [`causal_self_attention`]).
///
/// # Shapes
/// - x: `[B, T, D]`
/// - output: `[B, T, D]`; `Err`: `[B, T, 3D]`
pub fn fused_causal_self_attention(
    x: Tensor<3>,
    c_attn: &Linear,
    c_proj: &Linear,
    heads: usize,
    rope: Option<crate::rotation::Rope>,
    dropout: &Dropout,
) -> Result<Tensor<3>, Tensor<3>> {
    let dtype = x.dtype();
    let qkv = match rope {
        Some(rope) => crate::rotate_qk(crate::linear(c_attn, x), heads, 0, rope),
        None => crate::linear_in_products(c_attn, x),
    }; // [B, T, 3D]
    match causal_self_attention(qkv, heads, dropout) {
        // In the projection's type; the residual stream's after the projection.
        Ok(context) => Ok(crate::linear_into(c_proj, context, dtype)),
        Err(qkv) => Err(crate::cast_to(qkv, dtype)),
    }
}

/// [`causal_self_attention`] in Burn's tensor ops, on every backend: split the heads, attend
/// (as `ember_model::attention::causal_attention` does), merge.
pub fn causal_self_attention_reference(qkv: Tensor<3>, heads: usize) -> Tensor<3> {
    let [b, t, d3] = qkv.dims();
    let d = d3 / 3;
    let scale = 1.0 / ((d / heads) as f64).sqrt();
    let part = |i: usize| {
        qkv.clone()
            .slice([0..b, 0..t, i * d..(i + 1) * d])
            .reshape([b, t, heads, d / heads])
            .swap_dims(1, 2) // [B, H, T, K]
    };
    let (q, k, v) = (part(0), part(1), part(2));
    let weights = causal_softmax_reference(q.matmul(k.swap_dims(2, 3)), scale); // [B, H, T, T]
    weights.matmul(v).swap_dims(1, 2).reshape([b, t, d])
}

/// `dropout(softmax(Q K^T / sqrt(K) + mask)) V` for `T` queries at positions `start..start + T`
/// over a KV cache's whole buffer: query `i` sees keys `0..=start + i`, which also hides every
/// position not written yet. The buffer's shape stays the same from one decoding step to the
/// next, so GPU kernels keep their shapes.
///
/// # Shapes
/// - q: `[B, H, T, K]`
/// - k, v: `[B, H, C, K]` (the cache's capacity `C >= start + T`)
/// - output: `[B, H, T, K]`
pub fn cached_causal_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    start: usize,
    dropout: &Dropout,
) -> Tensor<4> {
    // Dropout, where it applies, is left to the reference.
    #[cfg(feature = "cube")]
    let (q, k, v) = match applied(dropout, &q.device()) == 0.0 {
        true => match super::cube::attention::cached_causal_attention(q, k, v, start) {
            Ok(context) => return context,
            Err(qkv) => qkv,
        },
        false => (q, k, v),
    };
    cached_causal_attention_reference(q, k, v, start, Some(dropout))
}

/// [`cached_causal_attention`] for queries at the position held by `position` `[1]` on the device
/// (written there between replays of a captured decoding step); the position is not read back
/// to the host on GPU backends.
///
/// # Shapes
/// - q: `[B, H, T, K]`
/// - k, v: `[B, H, C, K]` (`C >= position + T`)
/// - position: `[1]`
/// - output: `[B, H, T, K]`
pub fn cached_causal_attention_at(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    position: &Tensor<1, Int>,
    dropout: &Dropout,
) -> Tensor<4> {
    #[cfg(feature = "cube")]
    let (q, k, v) = match applied(dropout, &q.device()) == 0.0 {
        true => match super::cube::attention::cached_causal_attention_at(q, k, v, position) {
            Ok(context) => return context,
            Err(qkv) => qkv,
        },
        false => (q, k, v),
    };
    let start = super::read_position(position);
    cached_causal_attention_reference(q, k, v, start, Some(dropout))
}

#[cfg(test)]
/// The reference attention of `qkv` `[B, T, 3D]` with each weight multiplied by its
/// factor in `factors` (`[B, H, T, T]`, the dropout mask).
pub(crate) fn masked_reference(qkv: Tensor<3>, heads: usize, factors: &[f32]) -> Tensor<3> {
    let [b, t, d3] = qkv.dims();
    let (d, on) = (d3 / 3, qkv.device());
    let k = d / heads;
    let part = |i: usize| {
        qkv.clone()
            .slice([0..b, 0..t, i * d..(i + 1) * d])
            .reshape([b, t, heads, k])
            .swap_dims(1, 2)
    };
    let (q, kk, v) = (part(0), part(1), part(2));
    let scale = 1.0 / (k as f64).sqrt();
    let weights = crate::causal_softmax_reference(q.matmul(kk.swap_dims(2, 3)), scale);
    let mask = burn::tensor::TensorData::new(factors.to_vec(), [b, heads, t, t]);
    (weights * Tensor::<4>::from_data(mask, &on))
        .matmul(v)
        .swap_dims(1, 2)
        .reshape([b, t, d])
}

/// The probability with which `dropout` drops on `device`, as `Dropout::forward` decides it:
/// its own in training mode under autodiff, else 0.
fn applied(dropout: &Dropout, device: &Device) -> f64 {
    match dropout.training.is_enabled() && device.is_autodiff() {
        true => dropout.prob,
        false => 0.0,
    }
}

/// [`cached_causal_attention`] in Burn's tensor ops, on every backend: scores, a mask of the
/// keys each query may not see, softmax, dropout, values.
pub fn cached_causal_attention_reference(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    start: usize,
    dropout: Option<&Dropout>,
) -> Tensor<4> {
    let [_, _, t, head] = q.dims();
    let capacity = k.dims()[2];
    let hidden = Tensor::<2, Bool>::tril_mask([t, capacity], start as i64, &q.device())
        .reshape([1, 1, t, capacity]);
    let scores = q
        .matmul(k.swap_dims(2, 3))
        .mul_scalar(1.0 / (head as f64).sqrt());
    let weights = softmax(scores.mask_fill(hidden, MASKED_SCORE), 3); // [B, H, T, C]
    let weights = match dropout {
        Some(dropout) => dropout.forward(weights),
        None => weights,
    };
    weights.matmul(v)
}

/// Grouped keys or values `[B, G, S, K]` repeated for the `heads` query heads that read them,
/// `[B, heads, S, K]` (head `h` reads head `h / (heads / G)`, as transformers' `repeat_kv`); `x`
/// itself where `G = heads`.
pub fn repeat_kv(x: Tensor<4>, heads: usize) -> Tensor<4> {
    let [b, g, s, k] = x.dims();
    if g == heads {
        return x;
    }
    x.reshape([b, g, 1, s, k])
        .expand([b, g, heads / g, s, k])
        .reshape([b, heads, s, k])
}

/// `softmax(q K^T / sqrt(K) + mask) V` for one query position, with `dropout` on the weights:
/// a decoding step, over the keys cached so far or over a source (`mask`: its padding).
///
/// `mask` is `true` at keys the query may not see and broadcasts to `[B, H, 1, S]`. The flex
/// kernel takes plain tensors (where dropout does nothing) with no mask, or with a padding mask
/// `[B, 1, 1, S]` that hides the last keys of each row (right-padded sources, as ember pads
/// them); others take the reference.
///
/// Keys and values may be grouped (grouped-query attention): `G` heads, head `h` of the query
/// reading head `h / (H / G)`; the kernel reads them in place, the reference repeats them
/// ([`repeat_kv`]).
///
/// # Shapes
/// - q: `[B, H, 1, K]`
/// - k, v: `[B, G, S, K]`, `G` dividing `H` (`G = H` without groups)
/// - mask: broadcastable to `[B, H, 1, S]`
/// - output: `[B, H, 1, K]`
pub fn single_query_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<Tensor<4, Bool>>,
    dropout: Option<&Dropout>,
) -> Tensor<4> {
    // The mask is read on the host: only where the kernel may take the tensors.
    #[cfg(feature = "flex")]
    if super::flex::tensor::as_flex(&q).is_some()
        && let Some(lens) = key_lens(mask.as_ref(), q.dims()[0], k.dims()[2])
        && let Some(context) = super::flex::decode_attention::single_query(&q, &k, &v, &lens)
    {
        return context;
    }
    single_query_attention_reference(q, k, v, mask, dropout)
}

/// The keys each batch row sees where `mask` hides the last ones of each row (none: all `s`,
/// given as no lengths), each row seeing at least one; `None` for any other mask.
#[cfg(feature = "flex")]
fn key_lens(mask: Option<&Tensor<4, Bool>>, b: usize, s: usize) -> Option<Vec<usize>> {
    let Some(mask) = mask else {
        return Some(Vec::new());
    };
    let [mb, mh, mt, ms] = mask.dims();
    if (mb != b && mb != 1) || mh != 1 || mt != 1 || ms != s || s == 0 {
        return None;
    }
    let hidden = mask
        .to_data()
        .convert::<bool>()
        .try_into_vec::<bool>()
        .ok()?;
    let lens: Vec<usize> = hidden
        .chunks(s)
        .map(|row| row.iter().position(|&h| h).unwrap_or(s))
        .collect();
    let trailing = hidden
        .chunks(s)
        .zip(&lens)
        .all(|(row, &len)| len > 0 && row[len..].iter().all(|&h| h));
    trailing.then(|| match mb {
        1 => vec![lens[0]; b],
        _ => lens,
    })
}

/// [`single_query_attention`] in Burn's tensor ops, on every backend.
pub fn single_query_attention_reference(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<Tensor<4, Bool>>,
    dropout: Option<&Dropout>,
) -> Tensor<4> {
    let heads = q.dims()[1];
    let (k, v) = (repeat_kv(k, heads), repeat_kv(v, heads));
    let scale = 1.0 / (q.dims()[3] as f64).sqrt();
    let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(scale); // [B, H, 1, S]
    let scores = match mask {
        Some(mask) => scores.mask_fill(mask, MASKED_SCORE),
        None => scores,
    };
    let weights = softmax(scores, 3);
    let weights = match dropout {
        Some(dropout) => dropout.forward(weights),
        None => weights,
    };
    weights.matmul(v)
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use super::*;

    /// One query over a cache-like view (the first 37 of 50 positions, as a KV cache returns
    /// them): the flex loops take it, and equal the op's reference; with padding masks that
    /// hide the last keys of each row (per row, or one row for all), too. A mask of another
    /// shape (hiding keys inside a row) takes the reference.
    #[test]
    fn single_query_equals_its_reference() {
        let (q, k, v) = crate::check::cache_like_query(&Device::flex());
        let device = q.device();
        let pad = |rows: &[usize]| {
            let hidden: Vec<bool> = rows
                .iter()
                .flat_map(|&len| (0..37).map(move |s| s >= len))
                .collect();
            let data = burn::tensor::TensorData::new(hidden, [rows.len(), 1, 1, 37]);
            Tensor::<4, Bool>::from_data(data, &device)
        };
        let inner = {
            let mut hidden = vec![false; 2 * 37];
            hidden[3] = true;
            let data = burn::tensor::TensorData::new(hidden, [2, 1, 1, 37]);
            Tensor::<4, Bool>::from_data(data, &device)
        };
        let masks = [None, Some(pad(&[37, 20])), Some(pad(&[5])), Some(inner)];
        for (i, mask) in masks.into_iter().enumerate() {
            let taken = key_lens(mask.as_ref(), 2, 37);
            assert_eq!(taken.is_some(), i < 3, "mask {i}");
            if let Some(lens) = taken {
                assert!(crate::flex::decode_attention::single_query(&q, &k, &v, &lens).is_some());
            }
            let fast = single_query_attention(q.clone(), k.clone(), v.clone(), mask.clone(), None);
            let reference =
                single_query_attention_reference(q.clone(), k.clone(), v.clone(), mask, None);
            let diff = (fast - reference).abs().max().into_scalar::<f32>();
            assert!(diff < 1e-5, "mask {i}: differs by {diff}");
        }
    }

    /// Grouped keys and values (3 cached heads, each read by 2 of 6 query heads) through the
    /// kernel, which reads them in place, equal multi-head attention over keys repeated by
    /// `select` (head `h` reads cached head `h / 2`), and the op's reference; with a padding
    /// mask too.
    #[test]
    fn grouped_keys_are_read_by_their_heads() {
        let (q, k, v) = crate::check::cache_like_query(&Device::flex());
        let device = q.device();
        let q = Tensor::cat(vec![q.clone(), q * 0.5 - 1.0], 1); // [2, 6, 1, 32]
        let heads = Tensor::<1, burn::tensor::Int>::from_ints([0, 0, 1, 1, 2, 2], &device);
        let (k6, v6) = (
            k.clone().select(1, heads.clone()),
            v.clone().select(1, heads),
        );
        let hidden: Vec<bool> = [37, 20]
            .iter()
            .flat_map(|&len| (0..37).map(move |s| s >= len))
            .collect();
        let pad = Tensor::<4, Bool>::from_data(
            burn::tensor::TensorData::new(hidden, [2, 1, 1, 37]),
            &device,
        );
        for mask in [None, Some(pad)] {
            assert!(crate::flex::decode_attention::single_query(&q, &k, &v, &[]).is_some());
            let grouped =
                single_query_attention(q.clone(), k.clone(), v.clone(), mask.clone(), None);
            let every_head =
                single_query_attention(q.clone(), k6.clone(), v6.clone(), mask.clone(), None);
            let reference =
                single_query_attention_reference(q.clone(), k.clone(), v.clone(), mask, None);
            for other in [every_head, reference] {
                let diff = (grouped.clone() - other).abs().max().into_scalar::<f32>();
                assert!(diff < 1e-5, "differs by {diff}");
            }
        }
    }
}
