//! `ember prepare`: tokenize a corpus once into a folder that `ember train` memory-maps.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use ember_data::prepare::{PrepareOptions, Progress, TokenizerChoice, prepare};

/// Arguments of `ember prepare`.
#[derive(Args)]
pub struct PrepareArgs {
    /// Text files, or folders (their files in name order) [default: the config's data.path].
    #[arg(value_name = "INPUT")]
    inputs: Vec<PathBuf>,
    /// Folder to write: tokens.bin and the tokenizer (set `data.path` to it to train).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Take the input and the tokenizer settings from this run config's [data] section
    /// (tokenizer, bpe_vocab_size, tokenizer_file); the flags below override them.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Character-level (one id per distinct character) or byte-level BPE trained on the input.
    #[arg(long, value_enum)]
    tokenizer: Option<Kind>,
    /// Tokens of the BPE trained on the input [default: 512, or the config's].
    #[arg(long, value_name = "N")]
    vocab_size: Option<usize>,
    /// A Hugging Face tokenizer.json to encode with.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["tokenizer", "vocab_size", "tokenizer_from"])]
    tokenizer_file: Option<PathBuf>,
    /// The tokenizer of a checkpoint or run folder (to prepare a corpus for fine-tuning it with
    /// --init-from, or for resuming it).
    #[arg(long, value_name = "DIR", conflicts_with_all = ["tokenizer", "vocab_size"])]
    tokenizer_from: Option<PathBuf>,
    /// Train the BPE on the inputs' first N MB only (bounded memory and time for large corpora).
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    bpe_sample_mb: u64,
    /// Encoding workers [default: the machine's cores].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    threads: Option<u64>,
}

#[derive(Clone, Copy, ValueEnum)]
enum Kind {
    Char,
    Bpe,
}

pub fn run(args: PrepareArgs) -> Result<()> {
    let config = match &args.config {
        Some(path) => Some(ember_train::config::RunConfig::load(path)?),
        None => None,
    };
    let data = config.as_ref().map(|c| &c.data);
    let inputs = match (args.inputs.is_empty(), data) {
        (false, _) => args.inputs.clone(),
        (true, Some(data)) => vec![data.path.clone()],
        (true, None) => bail!("nothing to prepare: give input files or folders, or --config"),
    };
    let tokenizer = if let Some(file) = &args.tokenizer_file {
        TokenizerChoice::File(file.clone())
    } else if let Some(dir) = &args.tokenizer_from {
        let dir = ember_train::checkpoint::resolve(dir).unwrap_or_else(|_| dir.clone());
        TokenizerChoice::Given(
            ember_data::Tokenizer::load(&dir)
                .with_context(|| format!("--tokenizer-from {}", dir.display()))?,
        )
    } else {
        let from_config = data.map(|d| match (&d.tokenizer_file, d.tokenizer) {
            (Some(file), _) => TokenizerChoice::File(file.clone()),
            (None, ember_train::config::TokenizerKind::Char) => TokenizerChoice::Char,
            (None, ember_train::config::TokenizerKind::Bpe) => {
                TokenizerChoice::Bpe(d.bpe_vocab_size)
            }
        });
        match (args.tokenizer, from_config) {
            (Some(Kind::Char), _) => TokenizerChoice::Char,
            (Some(Kind::Bpe), _) => TokenizerChoice::Bpe(
                args.vocab_size
                    .or(data.map(|d| d.bpe_vocab_size))
                    .unwrap_or(512),
            ),
            (None, Some(TokenizerChoice::Bpe(n))) => {
                TokenizerChoice::Bpe(args.vocab_size.unwrap_or(n))
            }
            (None, Some(choice)) => choice,
            (None, None) => match args.vocab_size {
                Some(n) => TokenizerChoice::Bpe(n),
                None => TokenizerChoice::Char,
            },
        }
    };
    if let Some(n) = args.vocab_size
        && !matches!(tokenizer, TokenizerChoice::Bpe(_))
    {
        bail!(
            "--vocab-size {n} sizes a BPE trained on the input, but this tokenizer is {}: add \
             --tokenizer bpe, or leave --vocab-size out",
            match tokenizer {
                TokenizerChoice::Char => "character-level (the input's own characters)",
                _ => "a given tokenizer file",
            }
        );
    }
    // The files would sit beside a model's, and the folder become two things at once.
    if let Some(file) = ember_train::hf::ember_files(&args.out) {
        bail!(
            "--out {}: holds an ember run or checkpoint (`{file}`); prepare into a folder of its own",
            args.out.display()
        );
    }
    if ember_train::hf::is_hf_folder(&args.out) {
        bail!(
            "--out {}: holds a Hugging Face model; prepare into a folder of its own",
            args.out.display()
        );
    }
    let threads = args
        .threads
        .map(|n| n as usize)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let options = PrepareOptions {
        inputs,
        out: args.out.clone(),
        tokenizer,
        threads,
        piece_bytes: ember_data::prepare::PIECE_BYTES,
        bpe_sample_bytes: args.bpe_sample_mb << 20,
    };
    let started = Instant::now();
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg:>10} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    let mut stage = "";
    let prepared = prepare(&options, &mut |p: Progress| {
        if p.stage != stage {
            stage = p.stage;
            bar.reset();
            bar.set_length(p.total);
            bar.set_message(p.stage);
        }
        bar.set_position(p.done);
    });
    bar.finish_and_clear();
    let prepared = prepared?;
    let secs = started.elapsed().as_secs_f64();
    let tokens = prepared.header.tokens;
    eprintln!(
        "prepared {}: {} tokens ({} bytes each) of {} MB of text in {:.1} s (encoding {:.1} s: {:.1} MB/s, {:.0} tokens/s); tokenizer {}",
        args.out.display(),
        tokens,
        prepared.header.width,
        prepared.bytes as f64 / 1e6,
        secs,
        prepared.encode_secs,
        prepared.bytes as f64 / 1e6 / prepared.encode_secs.max(1e-9),
        tokens as f64 / prepared.encode_secs.max(1e-9),
        prepared.tokenizer.describe()
    );
    if prepared.unknown > 0 {
        eprintln!(
            "note: {} pieces of the text are outside the vocabulary (mapped to unknown)",
            prepared.unknown
        );
    }
    eprintln!(
        "train with: ember train --config CONFIG --set 'data.path=\"{}\"'",
        args.out.display()
    );
    Ok(())
}
