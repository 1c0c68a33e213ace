//! The decoding step's attention on flex: one query per batch row and head, through
//! [`crate::kernels::attention`], reading the KV cache's buffers in place.

use burn::backend::flex::FlexTensor;
use burn::tensor::{Shape, Tensor};

use crate::flex::tensor::{as_flex, contiguous, from_flex, from_values};
use crate::kernels::attention::{HeadsView, single_query_attention};

/// `softmax(q k^T / sqrt(K)) v` for a single query position over the first `key_lens[b]` keys of
/// each batch row `b` (all of them where `key_lens` is empty), or `None` where this path does
/// not apply (more than one query, another backend, autodiff, another dtype, unusual strides).
///
/// Grouped keys and values (`G` heads, each read by `H / G` query heads) are read where they
/// lie, not repeated per head.
///
/// # Shapes
/// - q: `[B, H, 1, K]`
/// - k, v: `[B, G, S, K]`, `G` dividing `H`
/// - output: `[B, H, 1, K]`
pub(crate) fn single_query(
    q: &Tensor<4>,
    k: &Tensor<4>,
    v: &Tensor<4>,
    key_lens: &[usize],
) -> Option<Tensor<4>> {
    let [b, h, t, d] = q.dims();
    let [_, g, s, _] = k.dims();
    if t != 1
        || s == 0
        || g == 0
        || !h.is_multiple_of(g)
        || k.dims() != [b, g, s, d]
        || v.dims() != [b, g, s, d]
    {
        return None;
    }
    let lens_fit = key_lens.is_empty()
        || (key_lens.len() == b && key_lens.iter().all(|&len| (1..=s).contains(&len)));
    if !lens_fit {
        return None;
    }
    let (q, k, v) = (contiguous(as_flex(q)?), as_flex(k)?, as_flex(v)?);
    let (start, end) = q.layout().contiguous_offsets()?;
    let query = &q.storage::<f32>()[start..end];
    let (keys, values) = (view(&k, h / g)?, view(&v, h / g)?);
    let mut out = vec![0.0; b * h * d];
    let scale = 1.0 / (d as f32).sqrt();
    single_query_attention(query, keys, values, [b, h, s, d], key_lens, scale, &mut out);
    Some(from_flex(from_values(out, Shape::new([b, h, 1, d]))))
}

/// A [`HeadsView`] of a `[B, G, S, K]` flex tensor whose last axis is contiguous, each head
/// read by `group` query heads.
fn view(t: &FlexTensor, group: usize) -> Option<HeadsView<'_>> {
    let layout = t.layout();
    let strides = layout.strides();
    if strides.iter().any(|&s| s < 0) || (strides[3] != 1 && layout.shape()[3] > 1) {
        return None;
    }
    Some(HeadsView {
        data: t.storage::<f32>(),
        offset: layout.start_offset(),
        strides: [
            strides[0] as usize,
            strides[1] as usize,
            strides[2] as usize,
        ],
        group,
    })
}
