//! `ember eval`

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{ArgGroup, Args, ValueEnum};
use ember_train::Split;

/// Arguments of `ember eval`.
#[derive(Args)]
#[command(group(ArgGroup::new("input").required(true).args(["data", "split"])))]
pub struct EvalArgs {
    /// Checkpoint folder, or a run folder (its newest checkpoint).
    #[arg(long, value_name = "DIR", default_value = "runs/small")]
    checkpoint: PathBuf,
    /// With a run folder: its best checkpoint (lowest validation loss) instead of the newest.
    #[arg(long)]
    best: bool,
    /// UTF-8 text file to score.
    #[arg(long, value_name = "FILE")]
    data: Option<PathBuf>,
    /// Score every token of one split of the corpus the model was trained on (its config's
    /// data.path, cut as training cut it) instead of a file: the exact figure behind training's
    /// sampled val loss.
    #[arg(long, value_enum)]
    split: Option<SplitArg>,
    /// Print one JSON object: {"loss", "perplexity", "tokens", "unknown", ...}.
    #[arg(long)]
    json: bool,
    /// Compute device: flex (CPU), ndarray, wgpu, vulkan, cuda[:N] (GPU ones need their cargo
    /// feature), or auto (a GPU if one answers, else flex).
    #[arg(long, value_name = "NAME", default_value = "flex")]
    device: String,
}

/// A split of the training corpus.
#[derive(Clone, Copy, ValueEnum)]
enum SplitArg {
    Train,
    Val,
}

pub fn run(args: EvalArgs) -> Result<()> {
    let checkpoint = crate::chosen_checkpoint(&args.checkpoint, args.best)?;
    if args.split.is_some() && ember_train::hf::is_hf_folder(&checkpoint) {
        bail!(
            "--split: {} is a Hugging Face model, which has no training corpus here; pass --data FILE",
            checkpoint.display()
        );
    }
    let device = ember_train::device::parse(&args.device)?;
    let lm = ember_train::load_lm(&checkpoint, &device)?;
    let (report, what) = match (args.split, &args.data) {
        (Some(split), _) => {
            let split = match split {
                SplitArg::Train => Split::Train,
                SplitArg::Val => Split::Val,
            };
            let corpus = &lm.config.data.path;
            let report = ember_train::eval::evaluate_split(&lm, split).with_context(|| {
                let hint = if corpus.is_relative() {
                    " (a relative path: run where training ran)"
                } else {
                    ""
                };
                format!(
                    "--split reads the corpus named by data.path in {}{hint}",
                    lm.dir.join(ember_train::checkpoint::CONFIG_FILE).display()
                )
            })?;
            (report, corpus.display().to_string())
        }
        (None, Some(data)) => (
            ember_train::eval::evaluate(&lm, data)?,
            data.display().to_string(),
        ),
        (None, None) => bail!("pass --data FILE or --split train|val"),
    };
    if report.unknown > 0 {
        eprintln!(
            "note: {} character(s) of {what} are not in the model's vocabulary (mapped to unknown)",
            report.unknown,
        );
    }
    if args.json {
        let mut json = serde_json::json!({
            "loss": report.loss,
            "perplexity": report.perplexity,
            "tokens": report.tokens,
            "unknown": report.unknown,
        });
        if let Some(bpc) = report.bits_per_char {
            json["bits_per_char"] = bpc.into();
        }
        println!("{json}");
    } else {
        println!("loss        {:.4} nats/token", report.loss);
        println!("perplexity  {:.3}", report.perplexity);
        if let Some(bpc) = report.bits_per_char {
            println!("bits/char   {bpc:.4}");
        }
        println!("tokens      {}", report.tokens);
        println!("unknown     {}", report.unknown);
    }
    Ok(())
}
