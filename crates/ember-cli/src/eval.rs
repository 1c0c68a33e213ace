//! `ember eval`

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

/// Arguments of `ember eval`.
#[derive(Args)]
pub struct EvalArgs {
    /// Checkpoint folder, or a run folder (its newest checkpoint).
    #[arg(long, value_name = "DIR", default_value = "runs/small")]
    checkpoint: PathBuf,
    /// UTF-8 text file to score.
    #[arg(long, value_name = "FILE")]
    data: PathBuf,
    /// Print one JSON object: {"loss", "perplexity", "tokens", "unknown", ...}.
    #[arg(long)]
    json: bool,
    /// Compute device: flex (CPU), ndarray, wgpu, vulkan, cuda[:N] (GPU ones need their cargo
    /// feature), or auto (a GPU if one answers, else flex).
    #[arg(long, value_name = "NAME", default_value = "flex")]
    device: String,
}

pub fn run(args: EvalArgs) -> Result<()> {
    let device = ember_train::device::parse(&args.device)?;
    let lm = ember_train::load_lm(&args.checkpoint, &device)?;
    let report = ember_train::eval::evaluate(&lm, &args.data)?;
    if report.unknown > 0 {
        eprintln!(
            "note: {} character(s) of {} are not in the model's vocabulary (mapped to unknown)",
            report.unknown,
            args.data.display()
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
