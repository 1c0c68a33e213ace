//! The GPT-style language model: token embedding + positions, N causal decoder blocks, a final
//! norm and a head over the vocabulary (optionally tied to the embedding).

use burn::module::Module;
use burn::nn::{
    Dropout, DropoutConfig, Embedding, EmbeddingConfig, Initializer, LayerNorm, Linear,
    LinearConfig,
};
use burn::tensor::{Bool, Device, Int, Tensor};

use crate::attention::kv_cache::DecoderCache;
use crate::blocks::decoder_block::{BlockWeights, DecoderBlock};
use crate::blocks::norm::NormKind;
use crate::models::decoder_only_config::DecoderOnlyConfig;
use crate::positions::{AdditivePositions, StepPosition};

/// A decoder-only transformer language model. Build it with [`DecoderOnlyConfig::init`].
#[derive(Module, Debug)]
pub struct DecoderOnly {
    /// Token embedding `[V, D]`.
    pub wte: Embedding,
    /// Additive positions (learned or sinusoidal); none for rotary.
    pub wpe: Option<AdditivePositions>,
    /// Dropout on the embedded input (tokens plus positions), as in GPT-2 and nanoGPT: with
    /// the blocks' dropout alone a model overfits sooner.
    pub drop: Dropout,
    /// The decoder blocks.
    pub blocks: Vec<DecoderBlock>,
    /// Final norm's weights.
    pub ln_f: LayerNorm,
    /// Output head `[D, V]`; `None` when tied to `wte`.
    pub lm_head: Option<Linear>,
    /// Positions the model accepts (`max_positions`).
    pub max_positions: usize,
    /// The norms' epsilon (Burn's `LayerNorm` keeps its own private).
    pub layer_norm_eps: f64,
    /// LayerNorm or RMSNorm.
    pub norm: NormKind,
}

/// Logits and, when asked for, the attention weights of every block.
#[derive(Debug, Clone)]
pub struct DecoderOutput {
    /// `[B, T, V]`
    pub logits: Tensor<3>,
    /// One entry per block (empty unless weights were asked for).
    pub weights: Vec<BlockWeights>,
}

impl DecoderOnly {
    pub(crate) fn new(config: DecoderOnlyConfig, device: &Device) -> Self {
        let block = config.block();
        let normal = Initializer::Normal {
            mean: 0.0,
            std: 0.02,
        };
        Self {
            wte: EmbeddingConfig::new(config.vocab_size, config.d_model)
                .with_initializer(normal.clone())
                .init(device),
            wpe: AdditivePositions::new(
                config.positional,
                config.position_init,
                config.max_positions(),
                config.d_model,
                device,
            ),
            drop: DropoutConfig::new(config.dropout).init(),
            blocks: (0..config.n_layers)
                .map(|_| DecoderBlock::new(&block, false, device))
                .collect(),
            ln_f: config
                .norm
                .init(config.d_model, config.layer_norm_eps, device),
            lm_head: (!config.tie_weights).then(|| {
                LinearConfig::new(config.d_model, config.vocab_size)
                    .with_bias(false)
                    .with_initializer(normal)
                    .init(device)
            }),
            max_positions: config.max_positions(),
            layer_norm_eps: config.layer_norm_eps,
            norm: config.norm,
        }
    }

    /// Logits for every position.
    ///
    /// # Shapes
    /// - tokens: `[B, T]`
    /// - output: `[B, T, V]`
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        self.forward_with(tokens, None, None, false).logits
    }

    /// The full forward pass.
    ///
    /// With a `cache`, `tokens` are the *new* tokens, at positions `cache.len()..`; their keys
    /// and values are appended. `pad` is `true` at padding, over cached + new positions.
    ///
    /// # Shapes
    /// - tokens: `[B, T]`
    /// - pad: `[B, cached + T]`
    /// - output logits: `[B, T, V]`
    ///
    /// # Panics
    /// If `cached + T` exceeds the positional table (`max_positions`); callers keep within it.
    pub fn forward_with(
        &self,
        tokens: Tensor<2, Int>,
        pad: Option<Tensor<2, Bool>>,
        mut cache: Option<&mut DecoderCache>,
        return_weights: bool,
    ) -> DecoderOutput {
        let [_, t] = tokens.dims();
        let device = tokens.device();
        let start = cache.as_ref().map_or(0, |c| c.len());
        assert!(
            start + t <= self.max_positions,
            "{} positions exceed the model's {}",
            start + t,
            self.max_positions
        );
        // A left-padded batch: each row's positions count from the end of its padding, and
        // attention never sees the padding.
        let row_starts = cache
            .as_ref()
            .and_then(|c| c.self_attn.first()?.row_starts());
        let pad = match cache.as_ref().and_then(|c| c.left_padding()) {
            Some(pads) => combine_pads(pad, left_padding_mask(pads, start + t, &device)),
            None => pad,
        };
        let mut x = crate::ops::embed(&self.wte, tokens); // [B, T, D]
        if let Some(wpe) = &self.wpe {
            let step = cache.as_ref().and_then(|c| c.position());
            x = x + wpe.forward_for(start, t, row_starts.as_deref(), step, &device);
        }
        let mut x = crate::ops::dropout(&self.drop, x);
        let mut weights = Vec::new();
        for (i, block) in self.blocks.iter().enumerate() {
            let caches = cache.as_mut().map(|c| {
                let (s, rest) = (&mut c.self_attn[i], &mut c.cross_attn[i]);
                (s, rest)
            });
            let (y, w) = block.forward(x, pad.clone(), None, caches, return_weights);
            x = y;
            if return_weights {
                weights.push(w);
            }
        }
        let x = self.norm.forward(&self.ln_f, x, self.layer_norm_eps);
        DecoderOutput {
            logits: self.head(x),
            weights,
        }
    }

    /// The position `position` `[1]` holds on the device, with the tables this model's
    /// positions read it through (sinusoidal encodings, rotary `cos`/`sin`, of every position
    /// it takes): what [`DecoderCache::read_position_from`] takes, so that one captured decoding
    /// step replays at every position.
    pub fn step_position(&self, position: Tensor<1, Int>) -> StepPosition {
        let device = position.device();
        let mut step = StepPosition::new(position);
        if let Some(wpe) = self.wpe.as_ref().filter(|p| p.wpe.is_none()) {
            step = step.with_sinusoids(self.max_positions, wpe.sinusoidal_width, &device);
        }
        if let Some(attn) = self.blocks.first().map(|b| &b.attn)
            && let Some(rope) = attn.rotary
        {
            // The tables' width: the part of each head the rotation turns.
            let head = attn.c_attn.weight.dims()[0] / attn.n_heads;
            let turned = attn.partial_rotary().unwrap_or(head);
            step = step.with_rotary(self.max_positions, turned, rope, &device);
        }
        step
    }

    /// A fresh cache sized for this model.
    pub fn new_cache(&self) -> DecoderCache {
        DecoderCache::new(self.blocks.len())
    }

    /// A fresh cache whose attention reads whole buffers, so that decoding steps keep their
    /// shapes between doublings (for GPU backends; see [`crate::KvCache::whole_buffer`]).
    pub fn new_whole_buffer_cache(&self) -> DecoderCache {
        DecoderCache::whole_buffer(self.blocks.len())
    }

    /// Mean next-token cross-entropy of `tokens` against `targets`.
    ///
    /// # Shapes
    /// - tokens, targets: `[B, T]`
    /// - output: `[1]`
    pub fn loss(&self, tokens: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1> {
        crate::loss::cross_entropy(self.forward(tokens), targets, None, 0.0)
    }

    /// Vocabulary size `V`.
    pub fn vocab_size(&self) -> usize {
        self.wte.weight.dims()[0]
    }

    /// `[B, T, D] -> [B, T, V]`, through the head or the tied embedding.
    fn head(&self, x: Tensor<3>) -> Tensor<3> {
        match &self.lm_head {
            Some(head) => crate::ops::linear(head, x),
            // The embedding's transpose as the head's weight, read in place: a decoding step's
            // row takes the few-row kernel on a GPU (one launch without cubek's product).
            None => crate::ops::affine(x, self.wte.weight.val().transpose(), None),
        }
    }
}

/// `true` at the first `pads[b]` of `s` positions of each row `b`.
///
/// # Shapes
/// - output: `[B, S]` with `B = pads.len()`
fn left_padding_mask(pads: &[usize], s: usize, device: &Device) -> Tensor<2, Bool> {
    let positions = Tensor::<1, Int>::arange(0..s as i64, device).reshape([1, s]);
    let b = pads.len();
    let pads: Vec<i64> = pads.iter().map(|&p| p as i64).collect();
    let pads = Tensor::<1, Int>::from_ints(pads.as_slice(), device).reshape([b, 1]);
    positions.expand([b, s]).lower(pads.expand([b, s]))
}

/// The union of two padding masks.
fn combine_pads(a: Option<Tensor<2, Bool>>, b: Tensor<2, Bool>) -> Option<Tensor<2, Bool>> {
    Some(match a {
        Some(a) => a.bool_or(b),
        None => b,
    })
}
