//! `ember export`

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, ValueEnum};

/// Arguments of `ember export`.
#[derive(Args)]
pub struct ExportArgs {
    /// Checkpoint folder, or a run folder (its newest checkpoint).
    #[arg(long, value_name = "DIR", default_value = "runs/small")]
    checkpoint: PathBuf,
    /// With a run folder: its best checkpoint (lowest validation loss) instead of the newest.
    #[arg(long)]
    best: bool,
    /// Folder to write.
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Output format.
    #[arg(long, value_enum, default_value = "hf")]
    format: Format,
}

/// Export formats.
#[derive(Clone, Copy, ValueEnum)]
enum Format {
    /// A Hugging Face folder (config.json, model.safetensors, tokenizer.json) that
    /// `transformers.AutoModelForCausalLM.from_pretrained` loads: GPT-2 for learned positions,
    /// GPT-NeoX for rotary ones.
    Hf,
}

pub fn run(args: ExportArgs) -> Result<()> {
    let checkpoint = crate::chosen_checkpoint(&args.checkpoint, args.best)?;
    let lm = ember_train::load_lm(&checkpoint, &burn::tensor::Device::flex())?;
    match args.format {
        Format::Hf => {
            lm.export_hf(&args.out)?;
        }
    }
    eprintln!(
        "exported {} (step {}) to {}",
        lm.dir.display(),
        lm.step,
        args.out.display()
    );
    eprintln!(
        "in Python: transformers.AutoModelForCausalLM.from_pretrained({:?})",
        args.out.display().to_string()
    );
    Ok(())
}
