//! The encoder-decoder transformer of "Attention Is All You Need": an encoder stack over the
//! source, a decoder stack over the target that also attends to the encoder output, and a
//! projection to the target vocabulary.

use burn::module::Module;
use burn::nn::{
    Dropout, DropoutConfig, Embedding, EmbeddingConfig, Initializer, LayerNorm, LayerNormConfig,
    Linear, LinearConfig,
};
use burn::tensor::{Bool, Device, Int, Tensor};

use crate::attention::kv_cache::DecoderCache;
use crate::blocks::decoder_block::{BlockWeights, DecoderBlock, Memory};
use crate::blocks::encoder_block::EncoderBlock;
use crate::models::decoder_only::DecoderOutput;
use crate::models::encoder_decoder_config::EncoderDecoderConfig;
use crate::ops::layer_norm;
use crate::positions::{AdditivePositions, PositionInit};

/// An encoder-decoder transformer. Build it with [`EncoderDecoderConfig::init`].
#[derive(Module, Debug)]
pub struct EncoderDecoder {
    /// Source token embedding `[V_src, D]` (also the target's when shared).
    pub src_embed: Embedding,
    /// Target token embedding `[V_tgt, D]`; `None` when shared with the source.
    pub tgt_embed: Option<Embedding>,
    /// Additive positions, shared by encoder and decoder; none for rotary.
    pub positions: Option<AdditivePositions>,
    /// Encoder blocks.
    pub encoder: Vec<EncoderBlock>,
    /// Final encoder LayerNorm (pre-norm models only).
    pub encoder_norm: Option<LayerNorm>,
    /// Decoder blocks, with cross-attention.
    pub decoder: Vec<DecoderBlock>,
    /// Final decoder LayerNorm (pre-norm models only).
    pub decoder_norm: Option<LayerNorm>,
    /// Output projection `[D, V_tgt]`; `None` when tied to the target embedding.
    pub output: Option<Linear>,
    /// Dropout on embeddings + positions.
    pub dropout: Dropout,
    /// `sqrt(D)` when embeddings are scaled, else 1.
    pub embed_scale: f64,
    /// Positions the model accepts on either side.
    pub max_positions: usize,
    /// The LayerNorms' epsilon (Burn's `LayerNorm` keeps its own private).
    pub layer_norm_eps: f64,
}

impl EncoderDecoder {
    pub(crate) fn new(config: EncoderDecoderConfig, device: &Device) -> Self {
        let block = config.block();
        // With sqrt(D) scaling, N(0, 1/D) embeddings come out at unit scale, as in the paper.
        let std = if config.scale_embeddings {
            (config.d_model as f64).powf(-0.5)
        } else {
            0.02
        };
        let embedding = |vocab| {
            EmbeddingConfig::new(vocab, config.d_model)
                .with_initializer(Initializer::Normal { mean: 0.0, std })
                .init(device)
        };
        let norm = || {
            config.norm_first.then(|| {
                LayerNormConfig::new(config.d_model)
                    .with_epsilon(config.layer_norm_eps)
                    .init(device)
            })
        };
        let tgt_is_src = config.shared_embeddings;
        Self {
            src_embed: embedding(config.src_vocab_size),
            tgt_embed: (!tgt_is_src).then(|| embedding(config.tgt_vocab_size)),
            positions: AdditivePositions::new(
                config.positional,
                PositionInit::Normal,
                config.max_positions,
                config.d_model,
                device,
            ),
            encoder: (0..config.n_encoder_layers)
                .map(|_| EncoderBlock::new(&block, device))
                .collect(),
            encoder_norm: norm(),
            decoder: (0..config.n_decoder_layers)
                .map(|_| DecoderBlock::new(&block, true, device))
                .collect(),
            decoder_norm: norm(),
            output: (!config.tie_output).then(|| {
                LinearConfig::new(config.d_model, config.tgt_vocab_size)
                    .with_bias(false)
                    .with_initializer(Initializer::Normal {
                        mean: 0.0,
                        std: 0.02,
                    })
                    .init(device)
            }),
            dropout: DropoutConfig::new(config.dropout).init(),
            embed_scale: if config.scale_embeddings {
                (config.d_model as f64).sqrt()
            } else {
                1.0
            },
            max_positions: config.max_positions,
            layer_norm_eps: config.layer_norm_eps,
        }
    }

    /// Runs the encoder once over the source.
    ///
    /// # Shapes
    /// - src: `[B, S]`
    /// - src_pad: `[B, S]`, `true` at padding
    /// - output: memory `[B, S, D]`
    pub fn encode(&self, src: Tensor<2, Int>, src_pad: Option<Tensor<2, Bool>>) -> Memory {
        self.encode_with(src, src_pad, false).0
    }

    /// [`encode`](Self::encode), also returning each encoder block's self-attention weights.
    pub fn encode_with(
        &self,
        src: Tensor<2, Int>,
        src_pad: Option<Tensor<2, Bool>>,
        return_weights: bool,
    ) -> (Memory, Vec<Tensor<4>>) {
        let mut x = self.embed(&self.src_embed, src, 0);
        let mut weights = Vec::new();
        for block in &self.encoder {
            let (y, w) = block.forward(x, src_pad.clone(), return_weights);
            x = y;
            weights.extend(w);
        }
        if let Some(norm) = &self.encoder_norm {
            x = layer_norm(norm, x, self.layer_norm_eps);
        }
        (
            Memory {
                states: x,
                pad: src_pad,
            },
            weights,
        )
    }

    /// Decodes target tokens against the encoder `memory` (teacher forcing when `tgt` is the
    /// whole shifted target; one step at a time with a cache).
    ///
    /// # Shapes
    /// - tgt: `[B, T]`, at positions `cache.len()..`
    /// - tgt_pad: `[B, cached + T]`
    /// - output logits: `[B, T, V_tgt]`
    pub fn decode(
        &self,
        tgt: Tensor<2, Int>,
        tgt_pad: Option<Tensor<2, Bool>>,
        memory: &Memory,
        mut cache: Option<&mut DecoderCache>,
        return_weights: bool,
    ) -> DecoderOutput {
        let start = cache.as_ref().map_or(0, |c| c.len());
        let mut x = self.embed(self.tgt_table(), tgt, start);
        let mut weights: Vec<BlockWeights> = Vec::new();
        for (i, block) in self.decoder.iter().enumerate() {
            let caches = cache
                .as_mut()
                .map(|c| (&mut c.self_attn[i], &mut c.cross_attn[i]));
            let (y, w) = block.forward(x, tgt_pad.clone(), Some(memory), caches, return_weights);
            x = y;
            if return_weights {
                weights.push(w);
            }
        }
        if let Some(norm) = &self.decoder_norm {
            x = layer_norm(norm, x, self.layer_norm_eps);
        }
        let logits = match &self.output {
            Some(output) => crate::ops::linear(output, x),
            None => {
                let [b, t, d] = x.dims();
                let w = self.tgt_table().weight.val(); // [V, D]
                let v = w.dims()[0];
                crate::ops::matmul(x.reshape([b * t, d]), w.transpose()).reshape([b, t, v])
            }
        };
        DecoderOutput { logits, weights }
    }

    /// Logits for a whole target under teacher forcing.
    ///
    /// # Shapes
    /// - src: `[B, S]`, tgt: `[B, T]`
    /// - output: `[B, T, V_tgt]`
    pub fn forward(
        &self,
        src: Tensor<2, Int>,
        src_pad: Option<Tensor<2, Bool>>,
        tgt: Tensor<2, Int>,
        tgt_pad: Option<Tensor<2, Bool>>,
    ) -> Tensor<3> {
        let memory = self.encode(src, src_pad);
        self.decode(tgt, tgt_pad, &memory, None, false).logits
    }

    /// A fresh decoder cache sized for this model.
    pub fn new_cache(&self) -> DecoderCache {
        DecoderCache::new(self.decoder.len())
    }

    /// Target vocabulary size.
    pub fn tgt_vocab_size(&self) -> usize {
        self.tgt_table().weight.dims()[0]
    }

    fn tgt_table(&self) -> &Embedding {
        self.tgt_embed.as_ref().unwrap_or(&self.src_embed)
    }

    /// Token embedding (scaled) + positions `start..start + T`, then dropout.
    ///
    /// # Shapes
    /// - tokens: `[B, T]`
    /// - output: `[B, T, D]`
    fn embed(&self, table: &Embedding, tokens: Tensor<2, Int>, start: usize) -> Tensor<3> {
        let [_, t] = tokens.dims();
        let device = tokens.device();
        assert!(
            start + t <= self.max_positions,
            "{} positions exceed the model's {}",
            start + t,
            self.max_positions
        );
        let mut x = crate::ops::embed(table, tokens).mul_scalar(self.embed_scale);
        if let Some(positions) = &self.positions {
            x = x + positions.forward(start, t, &device);
        }
        crate::ops::dropout(&self.dropout, x)
    }
}
