//! `ember average`

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

/// Arguments of `ember average`.
#[derive(Args)]
pub struct AverageArgs {
    /// Checkpoint folders, or run folders (all their checkpoints).
    #[arg(required = true, value_name = "CHECKPOINT")]
    inputs: Vec<PathBuf>,
    /// Average only the newest N of them.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(2..))]
    last: Option<u64>,
    /// New run folder to write the averaged checkpoint into.
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
}

pub fn run(args: AverageArgs) -> Result<()> {
    let averaged = ember_train::average::average_checkpoints(
        &args.inputs,
        args.last.map(|n| n as usize),
        &args.out,
        &burn::tensor::Device::flex(),
    )?;
    let steps: Vec<String> = averaged
        .sources
        .iter()
        .map(|(_, step)| step.to_string())
        .collect();
    eprintln!(
        "averaged {} checkpoints (steps {}) into {}",
        averaged.sources.len(),
        steps.join(", "),
        averaged.dir.display()
    );
    Ok(())
}
