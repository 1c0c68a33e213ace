//! Positional encodings: sinusoidal (Vaswani et al. 2017), learned, and rotary (RoPE, Su et al.
//! 2021). Sinusoidal and learned ones are added to the token embeddings; rotary ones rotate
//! queries and keys inside attention.

pub mod learned;
pub mod rotary;
pub mod sinusoidal;
pub mod step_position;

pub use rotary::{Rope, RopeScaling, apply_rotary};
pub use sinusoidal::sinusoidal_table;
pub use step_position::StepPosition;

use burn::module::Module;
use burn::nn::Embedding;
use burn::serde::{Deserialize, Serialize};
use burn::tensor::{Device, Int, Tensor};

use learned::learned_table;

/// Which positional encoding a model uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(crate = "burn::serde", rename_all = "lowercase")]
pub enum PositionalKind {
    /// Fixed `sin`/`cos` table added to the embeddings.
    Sinusoidal,
    /// A trained `[max_positions, D]` table added to the embeddings (GPT-2).
    #[default]
    Learned,
    /// Rotary: queries and keys are rotated by an angle proportional to their position.
    Rotary,
    /// No positional information (attention is then permutation-equivariant).
    None,
}

/// How a learned position table starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(crate = "burn::serde", rename_all = "lowercase")]
pub enum PositionInit {
    /// Random: `N(0, 0.02)` per entry, as GPT-2 and nanoGPT start it.
    #[default]
    Normal,
    /// The sinusoidal table of [`sinusoidal_table`], scaled to a root mean square of 0.02 (the
    /// normal start's standard deviation); the table is then trained like any other.
    Sinusoidal,
}

/// Positions added to the token embeddings (sinusoidal or learned).
#[derive(Module, Debug)]
pub struct AdditivePositions {
    /// The learned table `[max_positions, D]`, for [`PositionalKind::Learned`].
    pub wpe: Option<Embedding>,
    /// Width of the sinusoidal encoding when there is no learned table; 0 when unused.
    pub sinusoidal_width: usize,
}

impl AdditivePositions {
    /// Builds the additive encoding for `kind` (None for rotary and none); `init` says how a
    /// learned table starts.
    pub fn new(
        kind: PositionalKind,
        init: PositionInit,
        max_positions: usize,
        d_model: usize,
        device: &Device,
    ) -> Option<Self> {
        match kind {
            PositionalKind::Learned => Some(Self {
                wpe: Some(learned_table(init, max_positions, d_model, device)),
                sinusoidal_width: 0,
            }),
            PositionalKind::Sinusoidal => Some(Self {
                wpe: None,
                sinusoidal_width: d_model,
            }),
            PositionalKind::Rotary | PositionalKind::None => None,
        }
    }

    /// The encodings of positions `start..start + T`.
    ///
    /// # Shapes
    /// - output: `[1, T, D]`
    pub fn forward(&self, start: usize, t: usize, device: &Device) -> Tensor<3> {
        match &self.wpe {
            Some(wpe) => crate::ops::embed_range(wpe, start, t),
            None => sinusoidal_table(start, t, self.sinusoidal_width, device).unsqueeze(),
        }
    }

    /// The encoding of the one position `step` holds on the device, looked up there (a
    /// captured decoding step, replayed at every position: see
    /// [`crate::DecoderCache::read_position_from`]); `None` for sinusoidal encodings when
    /// `step` has no table of them.
    ///
    /// # Shapes
    /// - output: `[1, 1, D]`
    pub fn forward_at(&self, step: &StepPosition) -> Option<Tensor<3>> {
        match &self.wpe {
            Some(wpe) => Some(crate::ops::embed(
                wpe,
                step.position.clone().reshape([1, 1]),
            )),
            None => step.sinusoid(),
        }
    }

    /// The encodings of a forward pass's `t` positions, wherever they sit: a one-token step whose
    /// position `step` holds on the device looks it up there ([`Self::forward_at`]); a
    /// left-padded batch has each row's own start (`row_starts`, [`Self::forward_rows`]);
    /// otherwise every row is at `start..start + t` ([`Self::forward`]).
    ///
    /// # Shapes
    /// - output: `[1, T, D]`, or `[B, T, D]` with `B = row_starts.len()`
    pub fn forward_for(
        &self,
        start: usize,
        t: usize,
        row_starts: Option<&[i64]>,
        step: Option<&StepPosition>,
        device: &Device,
    ) -> Tensor<3> {
        if let Some(encoding) = step.filter(|_| t == 1).and_then(|s| self.forward_at(s)) {
            return encoding;
        }
        match row_starts {
            Some(starts) => self.forward_rows(starts, t, device),
            None => self.forward(start, t, device),
        }
    }

    /// The encodings of positions `starts[b]..starts[b] + T` for each row `b` of a batch whose
    /// rows start at different positions (left-padded prompts). Positions before 0 are padding,
    /// which attention masks out; they get position 0's encoding (learned) or their own
    /// (sinusoidal).
    ///
    /// # Shapes
    /// - output: `[B, T, D]` with `B = starts.len()`
    pub fn forward_rows(&self, starts: &[i64], t: usize, device: &Device) -> Tensor<3> {
        let b = starts.len();
        match &self.wpe {
            Some(wpe) => {
                let positions: Vec<i64> = starts
                    .iter()
                    .flat_map(|&s| (s..s + t as i64).map(|p| p.max(0)))
                    .collect();
                let positions = Tensor::<1, Int>::from_ints(positions.as_slice(), device);
                crate::ops::embed(wpe, positions.reshape([b, t]))
            }
            None => Tensor::stack(
                starts
                    .iter()
                    .map(|&s| {
                        sinusoidal::sinusoidal_table_from(s, t, self.sinusoidal_width, device)
                    })
                    .collect(),
                0,
            ),
        }
    }
}
