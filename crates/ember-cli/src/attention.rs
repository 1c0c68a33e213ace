//! `ember attention`

use std::path::{Path, PathBuf};

use crate::heatmap::{Heatmaps, draw};
use anyhow::{Context, Result, bail};
use clap::Args;
use ember_infer::{AttentionMap, cross_attention, mean_over_heads, self_attention};

/// Arguments of `ember attention`.
#[derive(Args)]
pub struct AttentionArgs {
    /// Checkpoint folder, or a run folder (its newest checkpoint).
    #[arg(long, value_name = "DIR", default_value = "runs/small")]
    checkpoint: PathBuf,
    /// With a run folder: its best checkpoint (lowest validation loss) instead of the newest.
    #[arg(long)]
    best: bool,
    /// The text to run the model on (for a translation model: the source sentence).
    #[arg(long)]
    text: String,
    /// For a translation model: the translation to align with (default: the model's own).
    #[arg(long, value_name = "TRANSLATION")]
    target: Option<String>,
    /// Draw only this layer (0-based) [default: every layer].
    #[arg(long, value_name = "L")]
    layer: Option<usize>,
    /// Draw only this head (0-based) [default: every head; translation: the mean of heads].
    #[arg(long, value_name = "H")]
    head: Option<usize>,
    /// Picture to write: PNG, or SVG when the name ends in .svg.
    #[arg(long, value_name = "FILE", default_value = "attention.png")]
    out: PathBuf,
    /// Also write the drawn weights as JSON.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Compute device: flex (CPU), ndarray, wgpu, vulkan, cuda[:N] (GPU ones need their cargo
    /// feature), or auto (a GPU if one answers, else flex).
    #[arg(long, value_name = "NAME", default_value = "flex")]
    device: String,
}

/// Keeps the maps of the chosen layer and head, after checking both exist.
fn select(
    maps: Vec<AttentionMap>,
    layers: usize,
    heads: usize,
    layer: Option<usize>,
    head: Option<usize>,
) -> Result<Vec<AttentionMap>> {
    if let Some(l) = layer
        && l >= layers
    {
        bail!(
            "--layer {l} is out of range: the model has {layers} layers (0 to {})",
            layers - 1
        );
    }
    if let Some(h) = head
        && h >= heads
    {
        bail!(
            "--head {h} is out of range: the model has {heads} heads (0 to {})",
            heads - 1
        );
    }
    Ok(maps
        .into_iter()
        .filter(|m| layer.is_none_or(|l| m.layer == l) && (head.is_none() || m.head == head))
        .collect())
}

pub fn run(args: AttentionArgs) -> Result<()> {
    let checkpoint = crate::chosen_checkpoint(&args.checkpoint, args.best)?;
    if args.text.is_empty() {
        bail!("--text is empty: give the text whose attention to draw");
    }
    let device = ember_train::device::parse(&args.device)?;
    // A Hugging Face folder holds a language model; an ember run or checkpoint says which it is.
    let (dir, kind) = match ember_train::hf::is_hf_folder(&checkpoint) {
        true => (checkpoint.clone(), "decoder_only".to_string()),
        false => {
            let dir = ember_train::checkpoint::resolve(&checkpoint)?;
            let kind = ember_train::checkpoint::read_state(&dir)?.model_kind;
            (dir, kind)
        }
    };
    let (maps, rows, columns, per_row, what) = if kind == "encoder_decoder" {
        translation_maps(&args, &dir, &device)?
    } else {
        lm_maps(&args, &dir, &device)?
    };
    let title = format!("{what}: {}", dir.display());
    draw(
        &Heatmaps {
            maps: &maps,
            rows: &rows,
            columns: &columns,
            per_row,
            title,
        },
        &args.out,
    )?;
    if let Some(path) = &args.json {
        let json = serde_json::json!({
            "rows": rows,
            "columns": columns,
            "maps": maps.iter().map(|m| serde_json::json!({"layer": m.layer, "head": m.head, "weights": m.weights})).collect::<Vec<_>>(),
        });
        std::fs::write(path, json.to_string())
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    eprintln!("wrote {} ({} panel(s))", args.out.display(), maps.len());
    Ok(())
}

type Maps = (Vec<AttentionMap>, Vec<String>, Vec<String>, usize, String);

fn lm_maps(args: &AttentionArgs, checkpoint: &Path, device: &burn::tensor::Device) -> Result<Maps> {
    if args.target.is_some() {
        bail!(
            "--target is for translation models; {} holds a language model",
            checkpoint.display()
        );
    }
    let lm = ember_train::load_lm(checkpoint, device)?;
    let ids = lm.tokenizer.encode(&args.text)?.ids;
    let context = lm.config.model.context_len;
    if ids.len() > context {
        bail!(
            "--text has {} tokens, more than the model's context of {context}; shorten it",
            ids.len()
        );
    }
    let (layers, heads) = (lm.config.model.n_layers, lm.config.model.n_heads);
    let maps = select(
        self_attention(&lm.model, &ids),
        layers,
        heads,
        args.layer,
        args.head,
    )?;
    let tokens: Vec<String> = ids.iter().map(|&i| lm.tokenizer.decode(&[i])).collect();
    let per_row = if args.layer.is_some() {
        (heads as f64).sqrt().ceil() as usize
    } else if args.head.is_some() {
        layers.min(4)
    } else {
        heads
    };
    Ok((
        maps,
        tokens.clone(),
        tokens,
        per_row,
        "self-attention".into(),
    ))
}

fn translation_maps(
    args: &AttentionArgs,
    checkpoint: &Path,
    device: &burn::tensor::Device,
) -> Result<Maps> {
    use ember_data::parallel::{BOS, EOS, PAD};
    let t = ember_train::load_translator(checkpoint, device)?;
    let src = t.tokenizers.encode_source(&args.text)?;
    let max = t.config.model.max_positions;
    if src.len() > max {
        bail!(
            "--text has {} tokens, more than the model's {max} positions; shorten it",
            src.len()
        );
    }
    let target_ids = match &args.target {
        Some(text) => t.tokenizers.tgt.encode(text)?.ids,
        None => {
            let options = ember_train::translation::greedy_options(t.config.data.max_len);
            ember_infer::translate_batch(&t.model, std::slice::from_ref(&src), PAD, &options)
                .remove(0)
                .tokens
        }
    };
    if target_ids.len() + 1 > max {
        bail!(
            "--target has {} tokens, more than the model's {} positions",
            target_ids.len(),
            max - 1
        );
    }
    let tgt_in: Vec<u32> = std::iter::once(BOS)
        .chain(target_ids.iter().copied())
        .collect();
    let (layers, heads) = (t.config.model.n_decoder_layers, t.config.model.n_heads);
    let all = cross_attention(&t.model, &src, &tgt_in);
    let maps = match args.head {
        Some(_) => select(all, layers, heads, args.layer, args.head)?,
        None => select(mean_over_heads(&all), layers, heads, args.layer, None)?,
    };
    let name = |ids: &[u32]| -> Vec<String> {
        ids.iter().map(|&i| t.tokenizers.src.decode(&[i])).collect()
    };
    // Row i reads target token i and predicts the next one: label rows by the predicted token.
    let outputs: Vec<u32> = target_ids
        .iter()
        .copied()
        .chain(std::iter::once(EOS))
        .collect();
    let rows: Vec<String> = outputs
        .iter()
        .map(|&i| t.tokenizers.tgt.decode(&[i]))
        .collect();
    let per_row = if args.layer.is_some() {
        1
    } else {
        layers.min(3)
    };
    Ok((
        maps,
        rows,
        name(&src),
        per_row,
        "cross-attention (target rows, source columns)".into(),
    ))
}
