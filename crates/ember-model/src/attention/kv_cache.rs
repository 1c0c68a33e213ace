//! Key/value cache for incremental decoding: the keys and values of tokens already seen, so
//! that each new token costs one row of attention instead of a full recomputation.

use burn::tensor::Tensor;

use crate::ops::RotaryAt;
use crate::positions::StepPosition;

/// Cached keys and values of one attention layer.
///
/// For self-attention it grows by the new tokens at every step; for cross-attention it holds
/// the projected encoder output, computed once per source batch. Self-attention keys and values
/// live in buffers with room to spare (doubled when full), written in place, so a step does
/// not copy everything cached so far.
///
/// Attention normally reads the valid positions only, so every decoding step has a new key
/// length. A cache made [`KvCache::whole_buffer`] is read whole, the positions not yet written
/// masked out: the step's shapes then change only when the buffer doubles (64, 128, 256, ...),
/// which GPU backends that compile and tune a kernel per shape need; the masked positions cost
/// arithmetic, so the CPU keeps the valid-rows reading.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    /// Keys `[B, H, capacity, K]` (already rotated when the model uses RoPE); the first `len`
    /// positions are valid.
    k: Option<Tensor<4>>,
    /// Values `[B, H, capacity, K]`.
    v: Option<Tensor<4>>,
    /// Valid positions.
    len: usize,
    /// Attention reads the whole buffer, masked past `len`.
    whole_buffer: bool,
    /// Per batch row, how many positions of padding come before its sequence (a batch of
    /// prompts of different lengths, left-padded to one length); empty when none.
    left_padding: Vec<usize>,
    /// The position of the step's token on the device, which the kernels read in place of
    /// `len` when set (see [`DecoderCache::read_position_from`]).
    position: Option<StepPosition>,
}

/// The keys and values a step's queries attend to ([`KvCache::append_keys`]).
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)] // one per attention call, passed by value and consumed
pub enum Keys {
    /// Exactly the positions seen so far, `[B, H, S, K]` each.
    Seen(Tensor<4>, Tensor<4>),
    /// A [`KvCache::whole_buffer`] cache's buffers, `[B, H, capacity, K]` each: query `i` of the
    /// step sees keys `..= start + i`, the positions after them not written yet; `step` is the
    /// step's position on the device where the cache reads it from there.
    Buffer {
        k: Tensor<4>,
        v: Tensor<4>,
        start: usize,
        step: Option<StepPosition>,
    },
}

/// Smallest buffer a self-attention cache allocates, in positions.
const MIN_CAPACITY: usize = 64;

impl KvCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty cache that attention reads whole, the unwritten positions masked.
    pub fn whole_buffer() -> Self {
        Self {
            whole_buffer: true,
            ..Self::default()
        }
    }

    /// An empty cache for a batch whose row `b` starts with `left_padding[b]` positions of
    /// padding: attention masks them, and row `b`'s tokens sit at positions counted from the end
    /// of its padding.
    pub fn left_padded(left_padding: Vec<usize>) -> Self {
        Self {
            left_padding,
            ..Self::default()
        }
    }

    /// The padding before each row's sequence, for a [`KvCache::left_padded`] cache.
    pub fn left_padding(&self) -> Option<&[usize]> {
        (!self.left_padding.is_empty()).then_some(self.left_padding.as_slice())
    }

    /// The position of each row's first new token: the cached length less its padding, which
    /// is negative while the padding itself is fed.
    pub fn row_starts(&self) -> Option<Vec<i64>> {
        let len = self.len as i64;
        self.left_padding()
            .map(|pads| pads.iter().map(|&p| len - p as i64).collect())
    }

    /// True for a cache made with [`KvCache::whole_buffer`].
    pub fn reads_whole_buffer(&self) -> bool {
        self.whole_buffer
    }

    /// Number of cached positions `S`.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends the step's keys and values and gives those its queries attend to: the whole
    /// buffer where the cache is read whole and the causal mask alone applies (`causal_only`),
    /// else the positions seen so far.
    ///
    /// # Shapes
    /// - k, v: `[B, H, T, K]`
    pub fn append_keys(&mut self, k: Tensor<4>, v: Tensor<4>, causal_only: bool) -> Keys {
        if self.whole_buffer && causal_only {
            let (start, step) = (self.len, self.position.clone());
            let (k, v) = self.append_whole(k, v);
            return Keys::Buffer { k, v, start, step };
        }
        let (k, v) = self.append(k, v);
        Keys::Seen(k, v)
    }

    /// The positions of a step's `t` rows, for rotary positions: a one-token step whose
    /// position is on the device reads its angles there; a left-padded batch has each row's
    /// own start; otherwise every row starts at the cached length (0 without a cache).
    pub fn rotary_at(cache: Option<&KvCache>, t: usize) -> RotaryAt {
        let step = cache.and_then(|c| c.position()).filter(|_| t == 1);
        if let Some((cos, sin)) = step.and_then(|s| s.rotary()) {
            return RotaryAt::Tables(cos, sin);
        }
        match cache.and_then(|c| c.row_starts()) {
            Some(starts) => RotaryAt::Rows(starts),
            None => RotaryAt::From(cache.map_or(0, |c| c.len())),
        }
    }

    /// Appends new keys and values along the sequence axis and returns all of them.
    ///
    /// # Shapes
    /// - k, v: `[B, H, T, K]`
    /// - output: `[B, H, S + T, K]` each
    pub fn append(&mut self, k: Tensor<4>, v: Tensor<4>) -> (Tensor<4>, Tensor<4>) {
        let (keys, values) = self.append_whole(k, v);
        let [b, h, _, d] = keys.dims();
        let valid = [0..b, 0..h, 0..self.len, 0..d];
        (keys.slice(valid.clone()), values.slice(valid))
    }

    /// Appends new keys and values and returns the whole buffers: the first `len()` positions
    /// are valid, the rest zeros to be masked.
    ///
    /// # Shapes
    /// - k, v: `[B, H, T, K]`
    /// - output: `[B, H, capacity, K]` each, `capacity >= S + T`
    pub fn append_whole(&mut self, k: Tensor<4>, v: Tensor<4>) -> (Tensor<4>, Tensor<4>) {
        let [b, h, t, d] = k.dims();
        let end = self.len + t;
        let capacity = self.k.as_ref().map_or(0, |k| k.dims()[2]);
        if end > capacity {
            let new_capacity = end.max(2 * capacity).max(MIN_CAPACITY);
            let device = k.device();
            let grow = |old: Option<Tensor<4>>| {
                let buffer = Tensor::<4>::zeros([b, h, new_capacity, d], &device);
                match old {
                    Some(old) if self.len > 0 => {
                        let kept = old.slice([0..b, 0..h, 0..self.len, 0..d]);
                        buffer.slice_assign([0..b, 0..h, 0..self.len, 0..d], kept)
                    }
                    _ => buffer,
                }
            };
            self.k = Some(grow(self.k.take()));
            self.v = Some(grow(self.v.take()));
        }
        let (k_buffer, v_buffer) = (
            self.k.take().expect("allocated"),
            self.v.take().expect("allocated"),
        );
        let (keys, values) = match &self.position {
            Some(step) => crate::ops::write_cache_rows_at(k_buffer, v_buffer, k, v, &step.position),
            None => crate::ops::write_cache_rows(k_buffer, v_buffer, k, v, self.len),
        };
        self.len = end;
        self.k = Some(keys.clone());
        self.v = Some(values.clone());
        (keys, values)
    }

    /// The step's position on the device, when the cache reads it from there (see
    /// [`DecoderCache::read_position_from`]).
    pub fn position(&self) -> Option<&StepPosition> {
        self.position.as_ref()
    }

    /// Replaces the contents (cross-attention: the projected encoder output).
    pub fn set(&mut self, k: Tensor<4>, v: Tensor<4>) {
        self.len = k.dims()[2];
        self.k = Some(k);
        self.v = Some(v);
    }

    /// The cached keys and values, if any.
    pub fn get(&self) -> Option<(Tensor<4>, Tensor<4>)> {
        let (k, v) = (self.k.clone()?, self.v.clone()?);
        let [b, h, _, d] = k.dims();
        let valid = [0..b, 0..h, 0..self.len, 0..d];
        Some((k.slice(valid.clone()), v.slice(valid)))
    }

    /// Keeps only the batch rows `indices` (beam search reorders hypotheses).
    pub fn select_batch(&mut self, indices: burn::tensor::Tensor<1, burn::tensor::Int>) {
        if !self.left_padding.is_empty() {
            let rows = indices.clone().into_data().convert::<i64>();
            let rows = rows.try_into_vec::<i64>().expect("integer indices");
            self.left_padding = rows
                .iter()
                .map(|&r| self.left_padding[r as usize])
                .collect();
        }
        let (len, whole_buffer, b) = (self.len, self.whole_buffer, indices.dims()[0]);
        let select = |buffer: Tensor<4>| {
            let [n, h, capacity, d] = buffer.dims();
            if whole_buffer || self.position.is_some() || b != n || 2 * len > capacity {
                // Attention reads past `len` (masked, so zeros there), rows are dropped, or
                // the buffer is mostly valid: every position is selected.
                return buffer.select(0, indices.clone());
            }
            // The same rows in another order: the valid positions alone are gathered and
            // written back into the buffer, in place (it is the cache's alone).
            let valid = [0..n, 0..h, 0..len, 0..d];
            let moved = buffer
                .clone()
                .slice(valid.clone())
                .select(0, indices.clone());
            buffer.slice_assign(valid, moved)
        };
        self.k = self.k.take().map(select);
        self.v = self.v.take().map(select);
    }
}

/// The caches of every layer of a decoder stack, plus the number of positions processed.
#[derive(Debug, Clone, Default)]
pub struct DecoderCache {
    /// One self-attention cache per decoder layer.
    pub self_attn: Vec<KvCache>,
    /// One cross-attention cache per decoder layer (empty for decoder-only models).
    pub cross_attn: Vec<KvCache>,
}

impl DecoderCache {
    /// An empty cache for `n_layers` layers.
    pub fn new(n_layers: usize) -> Self {
        Self {
            self_attn: vec![KvCache::new(); n_layers],
            cross_attn: vec![KvCache::new(); n_layers],
        }
    }

    /// An empty cache for `n_layers` layers whose self-attention reads whole buffers (see
    /// [`KvCache::whole_buffer`]): decoding steps keep their shapes between doublings.
    pub fn whole_buffer(n_layers: usize) -> Self {
        Self {
            self_attn: vec![KvCache::whole_buffer(); n_layers],
            cross_attn: vec![KvCache::new(); n_layers],
        }
    }

    /// An empty cache for `n_layers` layers of a left-padded batch (see
    /// [`KvCache::left_padded`]): row `b` starts with `left_padding[b]` positions of padding.
    pub fn left_padded(n_layers: usize, left_padding: Vec<usize>) -> Self {
        Self {
            self_attn: vec![KvCache::left_padded(left_padding); n_layers],
            cross_attn: vec![KvCache::new(); n_layers],
        }
    }

    /// The padding before each row's sequence, for a [`DecoderCache::left_padded`] cache.
    pub fn left_padding(&self) -> Option<&[usize]> {
        self.self_attn.first().and_then(KvCache::left_padding)
    }

    /// Number of target positions already processed (the offset of the next token).
    pub fn len(&self) -> usize {
        self.self_attn.first().map_or(0, KvCache::len)
    }

    /// True when no token was processed yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Makes every layer write and attend at the position `step` holds on the device instead
    /// of passing [`DecoderCache::len`] to its kernels, and the model encode that position from
    /// there (`None`: back to `len`).
    ///
    /// A decoding step recorded once as a graph and replayed for each token (CUDA graphs)
    /// replays its kernels with the arguments they were recorded with; reading the position
    /// from a buffer the host writes between replays is what lets one recording serve every
    /// position. The host still counts `len` (the buffers grow by it, and
    /// [`DecoderCache::set_len`] keeps it in step with replays that did not go through the
    /// model); the two must agree whenever the model runs. One token per step; `step` is made
    /// for the model ([`crate::DecoderOnly::step_position`]), with the tables its positions
    /// read.
    pub fn read_position_from(&mut self, step: Option<StepPosition>) {
        for cache in &mut self.self_attn {
            cache.position = step.clone();
        }
    }

    /// The step's position on the device, if the caches read it from there.
    pub fn position(&self) -> Option<&StepPosition> {
        self.self_attn.first().and_then(KvCache::position)
    }

    /// Sets the number of positions processed, without touching the buffers: for steps run by
    /// replaying a captured graph, which wrote their keys and values in place of the model.
    ///
    /// # Panics
    /// If `len` exceeds a buffer's capacity.
    pub fn set_len(&mut self, len: usize) {
        for cache in &mut self.self_attn {
            let capacity = cache.k.as_ref().map_or(0, |k| k.dims()[2]);
            assert!(
                len <= capacity,
                "{len} positions exceed the cache's capacity {capacity}"
            );
            cache.len = len;
        }
    }

    /// Positions the self-attention buffers hold before they must grow (0 before the first
    /// step).
    pub fn capacity(&self) -> usize {
        self.self_attn
            .first()
            .and_then(|c| c.k.as_ref())
            .map_or(0, |k| k.dims()[2])
    }

    /// Keeps only the batch rows `indices` in every layer (beam search).
    pub fn select_batch(&mut self, indices: burn::tensor::Tensor<1, burn::tensor::Int>) {
        for cache in self.self_attn.iter_mut().chain(self.cross_attn.iter_mut()) {
            cache.select_batch(indices.clone());
        }
    }

    /// [`DecoderCache::select_batch`] for the self-attention caches alone: for rows that only
    /// change places among rows with the same encoder output (a beam's hypotheses of one
    /// source), whose cross-attention keys and values are the same.
    pub fn select_self_batch(&mut self, indices: burn::tensor::Tensor<1, burn::tensor::Int>) {
        for cache in &mut self.self_attn {
            cache.select_batch(indices.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, Distribution, Int};

    fn steps(device: &Device) -> Vec<(Tensor<4>, Tensor<4>)> {
        let normal = Distribution::Normal(0.0, 1.0);
        (0..3)
            .map(|i| {
                let t = 1 + i % 2;
                let k = Tensor::<4>::random([3, 2, t, 4], normal, device);
                (k.clone(), k.mul_scalar(-2.0))
            })
            .collect()
    }

    /// Reordering the rows (in place, the valid positions alone) and dropping rows (the whole
    /// buffer) keep each row's keys and values, before and after further steps; a cache read
    /// whole keeps zeros past its valid positions.
    #[test]
    fn selecting_rows_keeps_their_keys_and_values() {
        let device = Device::flex();
        for (rows, whole) in [
            (vec![2, 0, 1], false),
            (vec![1, 1, 0], false),
            (vec![2, 0], false),
        ]
        .into_iter()
        .chain([(vec![2, 0, 1], true)])
        {
            let mut cache = match whole {
                true => KvCache::whole_buffer(),
                false => KvCache::new(),
            };
            let steps = steps(&device);
            let index = |rows: &[usize]| {
                let ids: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
                Tensor::<1, Int>::from_ints(ids.as_slice(), &device)
            };
            for (k, v) in &steps[..2] {
                cache.append(k.clone(), v.clone());
            }
            cache.select_batch(index(&rows));
            let (k2, v2) = steps[2].clone();
            let (k2, v2) = (k2.select(0, index(&rows)), v2.select(0, index(&rows)));
            cache.append(k2.clone(), v2.clone());
            let expected = |i: usize| {
                let parts: Vec<Tensor<4>> = steps[..2]
                    .iter()
                    .map(|(k, v)| [k, v][i].clone().select(0, index(&rows)))
                    .chain([[&k2, &v2][i].clone()])
                    .collect();
                Tensor::cat(parts, 2)
            };
            let (k, v) = cache.get().expect("cached");
            assert_eq!(cache.len(), 4);
            k.into_data().assert_eq(&expected(0).into_data(), true);
            v.into_data().assert_eq(&expected(1).into_data(), true);
            if whole {
                let buffer = cache.k.clone().expect("a buffer");
                let [b, h, capacity, d] = buffer.dims();
                let rest = buffer.slice([0..b, 0..h, 4..capacity, 0..d]);
                assert_eq!(rest.abs().max().into_scalar::<f32>(), 0.0);
            }
        }
    }
}
