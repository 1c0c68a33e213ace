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
    /// Print sacreBLEU's JSON ("name", "score", "signature", "verbose_score", "nrefs",
    /// "case", "eff", "tok", "smooth", "version"), plus "precisions", "bp", "ratio",
    /// "hyp_len" and "ref_len".
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
    let case = if args.lowercase { "lc" } else { "mixed" };
    // sacreBLEU's signature of its defaults. The version field names the scorer that made the
    // figure: ember's own 13a tokenizer and BLEU, not sacreBLEU.
    let version = format!("ember-{}", env!("CARGO_PKG_VERSION"));
    let signature = format!("nrefs:1|case:{case}|eff:no|tok:13a|smooth:exp|version:{version}");
    let ratio = b.hyp_len as f64 / b.ref_len.max(1) as f64;
    let verbose = format!(
        "{:.1}/{:.1}/{:.1}/{:.1} (BP = {:.3} ratio = {:.3} hyp_len = {} ref_len = {})",
        b.precisions[0],
        b.precisions[1],
        b.precisions[2],
        b.precisions[3],
        b.bp,
        ratio,
        b.hyp_len,
        b.ref_len
    );
    if args.json {
        let json = serde_json::json!({
            "name": "BLEU",
            "score": b.bleu,
            "signature": signature,
            "verbose_score": verbose,
            "nrefs": "1",
            "case": case,
            "eff": "no",
            "tok": "13a",
            "smooth": "exp",
            "version": version,
            "precisions": b.precisions,
            "bp": b.bp,
            "ratio": ratio,
            "hyp_len": b.hyp_len,
            "ref_len": b.ref_len,
        });
        println!("{}", serde_json::to_string_pretty(&json)?);
    } else {
        // sacreBLEU's text format (`-f text`).
        println!("BLEU|{signature} = {:.2} {verbose}", b.bleu);
    }
    Ok(())
}
