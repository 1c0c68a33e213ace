//! `ember`: train, sample from, and score transformers.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

// Tensors of many megabytes are allocated and freed at every step; mimalloc keeps freed
// memory for reuse where glibc returns it to the OS and pays page faults to get it back.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay` in mimalloc 3's `mimalloc.h` (the Rust bindings do not name it).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Tells mimalloc never to hand freed pages back to the OS. By default it purges them after
/// 10 ms, and a training step that frees and re-allocates the same buffers then pays a page
/// fault and a zeroing per page: 113,703 faults in 4 translation steps, against 1,537
/// without purging, and 7-25% shorter steps (README, "Benchmarks"). The process keeps its
/// peak memory, which it needs again at the next step anyway. `MIMALLOC_PURGE_DELAY` in the
/// environment still wins.
fn keep_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets a plain integer option; mimalloc reads it at each purge decision.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    }
}

mod attention;
mod average;
mod bleu;
mod eval;
mod export;
mod generate;
mod heatmap;
mod prepare;
mod signals;
mod stream;
mod train;
mod translate;

/// Train, sample from and score small transformers, on CPU or GPU.
#[derive(Parser)]
#[command(name = "ember", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model from a TOML config (and resume an interrupted run).
    Train(train::TrainArgs),
    /// Tokenize a corpus once into a folder that training memory-maps (for large corpora).
    Prepare(prepare::PrepareArgs),
    /// Sample text from a trained language model.
    // Negative numbers are values (`--temperature -1` gets the option's own message).
    #[command(allow_negative_numbers = true)]
    Generate(generate::GenerateArgs),
    /// Score a trained language model on a text file.
    Eval(eval::EvalArgs),
    /// Translate sentences (one per line) with a trained translation model.
    #[command(allow_negative_numbers = true)]
    Translate(translate::TranslateArgs),
    /// Corpus BLEU of translations against references (sacreBLEU's defaults).
    Bleu(bleu::BleuArgs),
    /// Draw a model's attention weights on a text as heatmaps (PNG or SVG).
    Attention(attention::AttentionArgs),
    /// Write a language model in another format (a Hugging Face GPT-2 or GPT-NeoX folder).
    Export(export::ExportArgs),
    /// Average the weights of a run's last checkpoints into a new run folder.
    Average(average::AverageArgs),
}

fn main() -> ExitCode {
    keep_freed_memory();
    // CPU work then runs on this thread and the pool's others, without a hand-over and a
    // wake-up per parallel operation (ember_kernels::flex::threads).
    ember_kernels::flex::threads::join_global_pool();
    // A bug in ember must still end in one readable line, not a backtrace.
    std::panic::set_hook(Box::new(|info| {
        let message = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        let place = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        ember_train::error::print_error_line(&format!(
            "internal error{place}: {message} (please report this)"
        ));
    }));
    let cli = Cli::parse();
    // The GPU ops' policy (kernels and strategies, split-K, cuDNN's attention) from the
    // environment, set once for the process; a bad value is refused here in one line.
    match ember_kernels::GpuPolicy::from_env() {
        Ok(policy) => ember_kernels::gpu_kernels::set_policy(policy),
        Err(e) => {
            ember_train::error::print_error_line(&e.to_string());
            return ExitCode::FAILURE;
        }
    }
    let result = match cli.command {
        Command::Train(args) => match train::run(args) {
            Ok(code) => return code,
            Err(e) => Err(e),
        },
        Command::Prepare(args) => prepare::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Eval(args) => eval::run(args),
        Command::Translate(args) => translate::run(args),
        Command::Bleu(args) => bleu::run(args),
        Command::Attention(args) => attention::run(args),
        Command::Export(args) => export::run(args),
        Command::Average(args) => average::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            ember_train::error::print_error_line(&one_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// The checkpoint a command reads: `path` as given, or with `--best` the best checkpoint of the
/// run folder `path`.
fn chosen_checkpoint(path: &std::path::Path, best: bool) -> anyhow::Result<std::path::PathBuf> {
    if best {
        Ok(ember_train::checkpoint::resolve_best(path)?)
    } else {
        Ok(path.to_path_buf())
    }
}

/// The error and its causes on a single line; a cause the message already quotes (as in
/// "cannot read F: No such file") is not repeated.
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.is_empty() {
            line = text;
        } else if !line.contains(&text) {
            line = format!("{line}: {text}");
        }
    }
    line.replace('\n', " ")
}
