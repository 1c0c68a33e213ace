//! Attention of one query per batch row and head over `S` cached keys: the decoding step with a
//! KV cache. A matrix multiply with one row (`[1, K] x [K, S]`) leaves most of a CPU idle and
//! repacks the keys on every call; these loops read the cache where it lies, once.

use crate::kernels::vector_math::{dot, exp, lanes_max, lanes_sum, madd, multiversion};

/// A `[B, H, S, K]` view into a buffer whose last axis is contiguous: element `(b, h, s, k)`
/// is `data[offset + b * strides[0] + (h / group) * strides[1] + s * strides[2] + k]` (heads of
/// a group read the same stored head: grouped-query attention's keys and values, `H / G` query
/// heads to each of `G`; `group` 1 for one stored head per query head).
#[derive(Debug, Clone, Copy)]
pub struct HeadsView<'a> {
    /// The buffer.
    pub data: &'a [f32],
    /// Where element `(0, 0, 0, 0)` is.
    pub offset: usize,
    /// Strides of the batch, head and sequence axes.
    pub strides: [usize; 3],
    /// Query heads per stored head (at least 1).
    pub group: usize,
}

impl<'a> HeadsView<'a> {
    /// The rows of head `h` of batch row `b`.
    #[inline(always)]
    fn rows(&self, b: usize, h: usize) -> Rows<'a> {
        Rows {
            data: self.data,
            at: self.offset + b * self.strides[0] + (h / self.group) * self.strides[1],
            step: self.strides[2],
        }
    }

    /// Row `s` of head `h` of batch row `b`: `len` values.
    #[cfg(test)]
    fn row(&self, b: usize, h: usize, s: usize, len: usize) -> &'a [f32] {
        self.rows(b, h).get(s, len)
    }
}

/// The key or value rows of one head: row `s` starts at `data[at + s * step]`.
#[derive(Clone, Copy)]
struct Rows<'a> {
    data: &'a [f32],
    at: usize,
    step: usize,
}

impl<'a> Rows<'a> {
    #[inline(always)]
    fn get(self, s: usize, len: usize) -> &'a [f32] {
        let start = self.at + s * self.step;
        &self.data[start..start + len]
    }
}

/// One (batch row, head): `out = softmax_s(scale * query . keys[s]) @ values` over `len` keys
/// starting at `keys_at` / `values_at`, `step` apart. `D` is the head size; 0 means "read it
/// from `query.len()`" (slower: the compiler cannot keep the output in registers).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn one_head<const F: bool, const D: usize>(
    query: &[f32],
    keys: Rows<'_>,
    values: Rows<'_>,
    len: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let d = if D == 0 { query.len() } else { D };
    let scores = &mut scores[..len];
    if !scores_avx512::<D>(query, keys, scale, scores) {
        for (s, score) in scores.iter_mut().enumerate() {
            *score = dot::<F, 16>(&query[..d], keys.get(s, d)) * scale;
        }
    }
    finish_head::<F, D>(scores, values, d, out)
}

/// The rest of [`one_head`] once the scaled scores are in: softmax, then the weighted sum of
/// the value rows into `out`.
#[inline(always)]
fn finish_head<const F: bool, const D: usize>(
    scores: &mut [f32],
    values: Rows<'_>,
    d: usize,
    out: &mut [f32],
) {
    let max = lanes_max(scores);
    for score in scores.iter_mut() {
        *score = exp::<F>(*score - max);
    }
    let inv = 1.0 / lanes_sum(scores);
    if D == 0 {
        let o = &mut out[..d];
        o.fill(0.0);
        for (s, &w) in scores.iter().enumerate() {
            for (x, &v) in o.iter_mut().zip(values.get(s, d)) {
                *x = madd::<F>(w, v, *x);
            }
        }
        o.iter_mut().for_each(|x| *x *= inv);
    } else {
        // Two accumulators (even and odd rows) halve the chain of dependent additions.
        let (mut even, mut odd) = ([0.0f32; D], [0.0f32; D]);
        let pairs = scores.len() / 2;
        for p in 0..pairs {
            let (w0, w1) = (scores[2 * p], scores[2 * p + 1]);
            let (v0, v1) = (values.get(2 * p, D), values.get(2 * p + 1, D));
            for j in 0..D {
                even[j] = madd::<F>(w0, v0[j], even[j]);
                odd[j] = madd::<F>(w1, v1[j], odd[j]);
            }
        }
        if scores.len() % 2 == 1 {
            let last = scores.len() - 1;
            let v = values.get(last, D);
            for j in 0..D {
                even[j] = madd::<F>(scores[last], v[j], even[j]);
            }
        }
        for j in 0..D {
            out[j] = (even[j] + odd[j]) * inv;
        }
    }
}

/// `scores[s] = scale * query . keys[s]` with AVX-512 where the CPU has it and the head size
/// `D` is a multiple of 16 up to 128; false (nothing written) otherwise.
#[inline(always)]
fn scores_avx512<const D: usize>(
    query: &[f32],
    keys: Rows<'_>,
    scale: f32,
    scores: &mut [f32],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if D != 0 && D.is_multiple_of(16) && D <= 128 && std::arch::is_x86_feature_detected!("avx512f")
    {
        let q: &[f32; D] = query.try_into().expect("query of length D");
        // SAFETY: the CPU has AVX-512F.
        unsafe { scores_avx512_unchecked::<D>(q, keys, scale, scores) };
        return true;
    }
    let _ = (query, keys, scale, scores);
    false
}

/// [`scores_avx512`]'s loop: the query in up to 8 registers, one fused multiply-add per 16
/// values of a key row, one horizontal sum per row.
///
/// # Safety
/// The CPU must have AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn scores_avx512_unchecked<const D: usize>(
    q: &[f32; D],
    keys: Rows<'_>,
    scale: f32,
    scores: &mut [f32],
) {
    use std::arch::x86_64::{
        __m512, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_reduce_add_ps, _mm512_setzero_ps,
    };
    let chunks = D / 16;
    let mut qv: [__m512; 8] = [_mm512_setzero_ps(); 8];
    for (c, v) in qv.iter_mut().enumerate().take(chunks) {
        // SAFETY: c * 16 + 16 <= D, the length of q.
        *v = unsafe { _mm512_loadu_ps(q.as_ptr().add(c * 16)) };
    }
    for (s, score) in scores.iter_mut().enumerate() {
        let row = keys.get(s, D);
        let mut acc = _mm512_setzero_ps();
        for (c, v) in qv.iter().enumerate().take(chunks) {
            // SAFETY: row has D values and c * 16 + 16 <= D.
            acc = _mm512_fmadd_ps(
                unsafe { _mm512_loadu_ps(row.as_ptr().add(c * 16)) },
                *v,
                acc,
            );
        }
        *score = _mm512_reduce_add_ps(acc) * scale;
    }
}

multiversion! {
    /// `out[b, h] = softmax_s(scale * q[b, h] . keys[b, h, s]) @ values[b, h]`, `s` over the
    /// first `key_lens[b]` keys of batch row `b` (each at least 1; all `S` where `key_lens` is
    /// empty): a source's padding at its end, hidden.
    ///
    /// `dims = [B, H, S, K]`; `q` and `out` are contiguous `[B, H, K]`.
    pub fn single_query_attention(
        q: &[f32],
        keys: HeadsView<'_>,
        values: HeadsView<'_>,
        dims: [usize; 4],
        key_lens: &[usize],
        scale: f32,
        out: &mut [f32]
    ) {
        let [batch, heads, all, d] = dims;
        let scores = &mut vec![0.0; all];
        for b in 0..batch {
            let len = key_lens.get(b).copied().unwrap_or(all);
            for h in 0..heads {
                let at = (b * heads + h) * d;
                let query = &q[at..at + d];
                let o = &mut out[at..at + d];
                let k = keys.rows(b, h);
                let v = values.rows(b, h);
                // Common head sizes get an unrolled loop with the output in registers.
                match d {
                    16 => one_head::<F, 16>(query, k, v, len, scale, scores, o),
                    32 => one_head::<F, 32>(query, k, v, len, scale, scores, o),
                    64 => one_head::<F, 64>(query, k, v, len, scale, scores, o),
                    128 => one_head::<F, 128>(query, k, v, len, scale, scores, o),
                    _ => one_head::<F, 0>(query, k, v, len, scale, scores, o),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// softmax(q k^T * scale) v in f64, one (b, h) pair, from contiguous `[S, K]` rows.
    fn reference(q: &[f32], keys: &[Vec<f32>], values: &[Vec<f32>], scale: f64) -> Vec<f64> {
        let scores: Vec<f64> = keys
            .iter()
            .map(|k| {
                scale
                    * q.iter()
                        .zip(k)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
            })
            .collect();
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        (0..q.len())
            .map(|j| {
                weights
                    .iter()
                    .zip(values)
                    .map(|(w, v)| w * v[j] as f64)
                    .sum::<f64>()
                    / total
            })
            .collect()
    }

    /// A deterministic pseudo-random value in [-2, 2).
    fn value(i: usize) -> f32 {
        ((i.wrapping_mul(2_654_435_761) % 10_007) as f32 / 10_007.0 - 0.5) * 4.0
    }

    #[test]
    fn matches_f64_reference_on_a_strided_cache() {
        // Head sizes with an unrolled path (16, 32, 64, 128) and one without (19); odd and
        // short key counts.
        for (head_size, len) in [(19, 33), (16, 7), (32, 33), (64, 40), (128, 1), (32, 16)] {
            check_against_reference(head_size, len);
        }
    }

    fn check_against_reference(head_size: usize, len: usize) {
        // A cache buffer [B, H, capacity, K] of which the first S positions are valid, as
        // KvCache keeps it.
        let (batch, heads, capacity) = (2, 3, 40);
        let buffer: Vec<f32> = (0..batch * heads * capacity * head_size)
            .map(value)
            .collect();
        let value_buffer: Vec<f32> = buffer.iter().map(|x| x * 0.7 + 0.1).collect();
        let strides = [
            heads * capacity * head_size,
            capacity * head_size,
            head_size,
        ];
        let keys = HeadsView {
            data: &buffer,
            offset: 0,
            strides,
            group: 1,
        };
        let values = HeadsView {
            data: &value_buffer,
            offset: 0,
            strides,
            group: 1,
        };
        let q: Vec<f32> = (0..batch * heads * head_size)
            .map(|i| value(i + 99_999))
            .collect();
        let scale = 1.0 / (head_size as f32).sqrt();
        let mut out = vec![0.0; batch * heads * head_size];
        let dims = [batch, heads, len, head_size];
        // Batch row 1 sees its first keys alone (padding after them) where there are several.
        let lens = [len, len.div_ceil(2)];
        single_query_attention(&q, keys, values, dims, &lens, scale, &mut out);
        for (b, &seen) in lens.iter().enumerate() {
            for h in 0..heads {
                let rows = |view: &HeadsView| -> Vec<Vec<f32>> {
                    (0..seen)
                        .map(|s| view.row(b, h, s, head_size).to_vec())
                        .collect()
                };
                let at = (b * heads + h) * head_size;
                let want = reference(
                    &q[at..at + head_size],
                    &rows(&keys),
                    &rows(&values),
                    scale as f64,
                );
                for (got, want) in out[at..at + head_size].iter().zip(&want) {
                    let err = (*got as f64 - want).abs();
                    assert!(err < 1e-5, "K = {head_size}, S = {len}: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn one_key_returns_its_value() {
        let keys = [0.5, -1.0, 2.0];
        let values = [3.0, 4.0, 5.0];
        let view = |data| HeadsView {
            data,
            offset: 0,
            strides: [3, 3, 3],
            group: 1,
        };
        let mut out = [0.0; 3];
        let dims = [1, 1, 1, 3];
        single_query_attention(
            &[1.0, 2.0, 3.0],
            view(&keys),
            view(&values),
            dims,
            &[],
            0.5,
            &mut out,
        );
        assert_eq!(out, values);
    }
}
