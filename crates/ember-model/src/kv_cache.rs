//! Key/value cache for incremental decoding: the keys and values of tokens already seen, so
//! that each new token costs one row of attention instead of a full recomputation.

use burn::tensor::Tensor;

/// Cached keys and values of one attention layer.
///
/// For self-attention it grows by the new tokens at every step; for cross-attention it holds
/// the projected encoder output, computed once per source batch.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    /// Keys `[B, H, S, K]` (already rotated when the model uses RoPE).
    k: Option<Tensor<4>>,
    /// Values `[B, H, S, K]`.
    v: Option<Tensor<4>>,
}

impl KvCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of cached positions `S`.
    pub fn len(&self) -> usize {
        self.k.as_ref().map_or(0, |k| k.dims()[2])
    }

    /// True when nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.k.is_none()
    }

    /// Appends new keys and values along the sequence axis and returns all of them.
    ///
    /// # Shapes
    /// - k, v: `[B, H, T, K]`
    /// - output: `[B, H, S + T, K]` each
    pub fn append(&mut self, k: Tensor<4>, v: Tensor<4>) -> (Tensor<4>, Tensor<4>) {
        let (k, v) = match (self.k.take(), self.v.take()) {
            (Some(old_k), Some(old_v)) => (
                Tensor::cat(vec![old_k, k], 2),
                Tensor::cat(vec![old_v, v], 2),
            ),
            _ => (k, v),
        };
        self.k = Some(k.clone());
        self.v = Some(v.clone());
        (k, v)
    }

    /// Replaces the contents (cross-attention: the projected encoder output).
    pub fn set(&mut self, k: Tensor<4>, v: Tensor<4>) {
        self.k = Some(k);
        self.v = Some(v);
    }

    /// The cached keys and values, if any.
    pub fn get(&self) -> Option<(Tensor<4>, Tensor<4>)> {
        Some((self.k.clone()?, self.v.clone()?))
    }

    /// Keeps only the batch rows `indices` (beam search reorders hypotheses).
    pub fn select_batch(&mut self, indices: burn::tensor::Tensor<1, burn::tensor::Int>) {
        self.k = self.k.take().map(|k| k.select(0, indices.clone()));
        self.v = self.v.take().map(|v| v.select(0, indices));
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

    /// Number of target positions already processed (the offset of the next token).
    pub fn len(&self) -> usize {
        self.self_attn.first().map_or(0, KvCache::len)
    }

    /// True when no token was processed yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keeps only the batch rows `indices` in every layer (beam search).
    pub fn select_batch(&mut self, indices: burn::tensor::Tensor<1, burn::tensor::Int>) {
        for cache in self.self_attn.iter_mut().chain(self.cross_attn.iter_mut()) {
            cache.select_batch(indices.clone());
        }
    }
}
