//! Scoring a trained language model on any UTF-8 text: loss, perplexity, bits per character.

use std::path::Path;

use burn::tensor::{Int, Tensor};
use ember_data::corpus;
use ember_infer::summed_losses;

use crate::error::{Result, TrainError};
use crate::lm_source::LoadedLm;
use crate::task::Split;

/// The score of a model on a text.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalReport {
    /// Mean cross-entropy per token, in nats.
    pub loss: f64,
    /// `exp(loss)`.
    pub perplexity: f64,
    /// Tokens scored (every token after the first).
    pub tokens: usize,
    /// Characters outside the vocabulary.
    pub unknown: usize,
    /// Bits per character, for character-level models.
    pub bits_per_char: Option<f64>,
}

/// Windows scored per forward pass.
const WINDOWS_PER_BATCH: usize = 16;

/// Scores every token of `path` given the tokens before it (up to one context of them): the
/// text is cut into consecutive windows of `context_len` predictions.
pub fn evaluate(lm: &LoadedLm, path: &Path) -> Result<EvalReport> {
    let text = corpus::read_text(path)?;
    let encoded = lm.tokenizer.encode(&text)?;
    score(
        lm,
        &encoded.ids,
        encoded.unknown,
        &path.display().to_string(),
    )
}

/// Scores one split of the corpus the model was trained on (`data.path` of its config, cut at
/// `data.train_fraction` exactly as training cut it), every token of it as [`evaluate`] does:
/// the whole split rather than the training loop's `eval_batches` random windows.
pub fn evaluate_split(lm: &LoadedLm, split: Split) -> Result<EvalReport> {
    let data = &lm.config.data;
    let ids: Vec<u32> = match ember_data::token_file::is_prepared(&data.path) {
        // A prepared corpus (`ember prepare`): its ids, made by the model's tokenizer.
        true => {
            let file = ember_data::TokenFile::open(&data.path, &lm.tokenizer)?;
            (0..file.len()).map(|i| file.get(i)).collect()
        }
        false => {
            let text = corpus::read_text(&data.path)?;
            lm.tokenizer.encode(&text)?.ids
        }
    };
    let (train, val) = corpus::split(&ids, data.train_fraction);
    let (ids, name) = match split {
        Split::Train => (train, "training"),
        Split::Val => (val, "validation"),
    };
    let unknown = lm.tokenizer.unknown_count(ids);
    let what = format!("the {name} split of {}", data.path.display());
    score(lm, ids, unknown, &what)
}

/// Scores `ids` (from `what`, for errors), of which `unknown` are outside the vocabulary.
fn score(lm: &LoadedLm, ids: &[u32], unknown: usize, what: &str) -> Result<EvalReport> {
    let ids: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
    if ids.len() < 2 {
        return Err(TrainError::Data(ember_data::DataError::TooShort {
            what: what.to_string(),
            tokens: ids.len(),
            needed: 2,
        }));
    }
    let t = lm.config.model.context_len;
    let device = lm.model.wte.weight.device();
    let starts: Vec<usize> = (0..ids.len() - 1).step_by(t).collect();
    let (full, partial): (Vec<usize>, Vec<usize>) =
        starts.into_iter().partition(|&s| s + t < ids.len());
    let windows = |batch: &[usize], len: usize| {
        let mut x = Vec::with_capacity(batch.len() * len);
        let mut y = Vec::with_capacity(batch.len() * len);
        for &s in batch {
            x.extend_from_slice(&ids[s..s + len]);
            y.extend_from_slice(&ids[s + 1..s + len + 1]);
        }
        (x, y)
    };
    // Batches of WINDOWS_PER_BATCH whole windows, one shape: on GPUs one captured pass
    // replayed per batch. The rest (a last smaller batch, a last shorter window) one by one.
    let batches: Vec<&[usize]> = full.chunks_exact(WINDOWS_PER_BATCH).collect();
    let shape = [WINDOWS_PER_BATCH, t];
    let summed = summed_losses(
        &device,
        shape,
        batches.len(),
        |i| windows(batches[i], t),
        |x, y| lm.model.loss(x, y),
    );
    let mut nll = summed.sum * (WINDOWS_PER_BATCH * t) as f64;
    let mut count = batches.len() * WINDOWS_PER_BATCH * t;
    let rest = full.chunks_exact(WINDOWS_PER_BATCH).remainder();
    let last = partial.iter().map(|&s| (vec![s], ids.len() - 1 - s));
    for (batch, len) in std::iter::once((rest.to_vec(), t)).chain(last) {
        if batch.is_empty() {
            continue;
        }
        let b = batch.len();
        let (x, y) = windows(&batch, len);
        let x = Tensor::<1, Int>::from_ints(x.as_slice(), &device).reshape([b, len]);
        let y = Tensor::<1, Int>::from_ints(y.as_slice(), &device).reshape([b, len]);
        nll += lm.model.loss(x, y).into_scalar::<f32>() as f64 * (b * len) as f64;
        count += b * len;
    }
    let loss = nll / count as f64;
    Ok(EvalReport {
        loss,
        perplexity: loss.exp(),
        tokens: count,
        unknown,
        bits_per_char: lm
            .tokenizer
            .is_char()
            .then(|| loss / std::f64::consts::LN_2),
    })
}
