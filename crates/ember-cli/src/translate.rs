//! `ember translate`

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use ember_infer::SearchOptions;

/// Arguments of `ember translate`.
#[derive(Args)]
pub struct TranslateArgs {
    /// Checkpoint folder, or a run folder (its newest checkpoint).
    #[arg(long, value_name = "DIR", default_value = "runs/multi30k-de-en")]
    checkpoint: PathBuf,
    /// With a run folder: its best checkpoint (lowest validation loss) instead of the newest.
    #[arg(long)]
    best: bool,
    /// Sentences to translate, one per line [default: standard input].
    #[arg(long, value_name = "FILE")]
    input: Option<PathBuf>,
    /// Beam width; 1 is greedy decoding.
    #[arg(long, value_name = "N", default_value_t = 4)]
    beam: usize,
    /// GNMT length penalty exponent: higher favours longer translations.
    #[arg(long, value_name = "A", default_value_t = 0.6)]
    length_penalty: f32,
    /// Most tokens per translation [default: the training max_len + 10].
    #[arg(long, value_name = "N")]
    max_len: Option<usize>,
    /// Compute device: flex (CPU), ndarray, wgpu, vulkan, cuda[:N] (GPU ones need their cargo
    /// feature), or auto (a GPU if one answers, else flex).
    #[arg(long, value_name = "NAME", default_value = "flex")]
    device: String,
}

pub fn run(args: TranslateArgs) -> Result<()> {
    let checkpoint = crate::chosen_checkpoint(&args.checkpoint, args.best)?;
    if args.beam == 0 {
        bail!("--beam must be at least 1, got 0");
    }
    if !args.length_penalty.is_finite() {
        bail!(
            "--length-penalty must be a number, got {}",
            args.length_penalty
        );
    }
    if args.max_len == Some(0) {
        bail!("--max-len must be at least 1, got 0");
    }
    let device = ember_train::device::parse(&args.device)?;
    let t = ember_train::load_translator(&checkpoint, &device)?;
    let lines: Vec<String> = match &args.input {
        Some(path) => ember_data::corpus::read_text(path)?
            .lines()
            .map(str::to_string)
            .collect(),
        None => std::io::stdin()
            .lock()
            .lines()
            .collect::<std::io::Result<_>>()
            .context("cannot read standard input")?,
    };
    // An empty line stays an empty line (the model would make up a sentence for it), so that
    // the output stays line-aligned with the input.
    let sources = lines
        .iter()
        .filter(|l| !l.trim().is_empty())
        .map(|l| t.tokenizers.encode_source(l.trim()))
        .collect::<ember_train::Result<Vec<_>>>()?;
    let mut options: SearchOptions =
        ember_train::translation::greedy_options(t.config.data.max_len);
    options.beam = args.beam;
    options.length_penalty = args.length_penalty;
    if let Some(max_len) = args.max_len {
        options.max_len = max_len;
    }
    let start = Instant::now();
    let count = sources.len();
    let translated =
        ember_train::translation::translate_all(&t.model, &t.tokenizers, sources, &options);
    let mut translated = translated.into_iter();
    let mut stdout = std::io::stdout().lock();
    for line in &lines {
        match line.trim().is_empty() {
            true => writeln!(stdout)?,
            false => writeln!(stdout, "{}", translated.next().unwrap_or_default())?,
        }
    }
    eprintln!(
        "{} sentences in {:.2}s (beam {}, checkpoint {} step {})",
        count,
        start.elapsed().as_secs_f64(),
        args.beam,
        t.dir.display(),
        t.step
    );
    Ok(())
}
