//! `ember bleu`

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use clap::Args;
use ember_data::bleu::corpus_bleu;

/// Arguments of `ember bleu`.
#[derive(Args)]
pub struct BleuArgs {
    /// Translations, one per line.
    #[arg(long, value_name = "FILE")]
    hyp: PathBuf,
    /// References, line-aligned with --hyp.
    #[arg(long = "ref", value_name = "FILE")]
    reference: PathBuf,
    /// Compare lowercased text (default: cased, as sacreBLEU).
    #[arg(long)]
    lowercase: bool,
    /// Print {"bleu", "precisions", "bp", "hyp_len", "ref_len"} as JSON.
    #[arg(long)]
    json: bool,
}

fn lines(path: &Path) -> Result<Vec<String>> {
    Ok(ember_data::corpus::read_text(path)?
        .lines()
        .map(str::to_string)
        .collect())
}

pub fn run(args: BleuArgs) -> Result<()> {
    let hyp = lines(&args.hyp)?;
    let reference = lines(&args.reference)?;
    if hyp.len() != reference.len() {
        bail!(
            "{} has {} lines but {} has {}: hypotheses and references must be line-aligned",
            args.hyp.display(),
            hyp.len(),
            args.reference.display(),
            reference.len()
        );
    }
    let b = corpus_bleu(&hyp, &reference, args.lowercase);
    if args.json {
        println!("{}", serde_json::to_string(&b)?);
    } else {
        println!(
            "BLEU = {:.2} {:.1}/{:.1}/{:.1}/{:.1} (BP = {:.3} ratio = {:.3} hyp_len = {} ref_len = {}) 13a, {}",
            b.bleu,
            b.precisions[0],
            b.precisions[1],
            b.precisions[2],
            b.precisions[3],
            b.bp,
            b.hyp_len as f64 / b.ref_len.max(1) as f64,
            b.hyp_len,
            b.ref_len,
            if args.lowercase {
                "lowercased"
            } else {
                "cased"
            }
        );
    }
    Ok(())
}
