//! `ember train`

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Result, bail};
use clap::Args;
use ember_train::config::Override;
use ember_train::init_from::InitFrom;
use ember_train::{Launch, RunConfig, TrainError, TranslationRunConfig};

/// Arguments of `ember train`.
#[derive(Args)]
pub struct TrainArgs {
    /// Run config (TOML with [model], [data] and [training] sections).
    #[arg(long, value_name = "FILE")]
    config: PathBuf,
    /// Compute device: flex (CPU), ndarray, wgpu, vulkan, cuda[:N] (GPU ones need their cargo
    /// feature), or auto (a GPU if one answers, else flex); or several, comma-separated
    /// (`--devices cuda:0,cuda:1`), for data-parallel training: each step's grad_accum
    /// micro-batches are spread over them. Overrides the config.
    #[arg(long, visible_alias = "devices", value_name = "NAME[,NAME...]")]
    device: Option<String>,
    /// Run folder for checkpoints, metrics and the loss plot [default: runs/<config name>].
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Set one config value, `section.key=value` (value in TOML; repeatable), e.g.
    /// `--set training.lr=3e-4 --set model.n_layers=6`. Checked like the file; saved with the run.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<String>,
    /// Continue from the newest checkpoint in the run folder.
    #[arg(long, conflicts_with = "overwrite")]
    resume: bool,
    /// Replace the run the folder already holds (its checkpoints, metrics and plot are removed
    /// first). Without this or --resume, a folder holding a run is refused.
    #[arg(long)]
    overwrite: bool,
    /// Start from these weights: an ember checkpoint or run folder, or a Hugging Face GPT-2
    /// folder (config.json, model.safetensors, tokenizer.json). Architecture and tokenizer come
    /// from DIR; the config's [model] may only set context_len and dropout.
    #[arg(long, value_name = "DIR")]
    init_from: Option<PathBuf>,
    /// Stop after this step (with a checkpoint), as if interrupted; `--resume` continues.
    #[arg(long, value_name = "STEP", hide = true, value_parser = clap::value_parser!(u64).range(1..))]
    stop_after: Option<u64>,
    /// Write no checkpoint, not even at the end: for benchmarks that time the steps alone (the
    /// run's weights are not kept).
    #[arg(long, hide = true, conflicts_with = "resume")]
    no_checkpoints: bool,
    /// Time every GPU kernel of the last N steps (device synchronised around each step) and
    /// print where the time went, kernel by kernel, when training ends. GPU devices only.
    #[arg(long, value_name = "N")]
    profile_steps: Option<u64>,
}

pub fn run(args: TrainArgs) -> Result<ExitCode> {
    let out = args.out.unwrap_or_else(|| {
        let name = args
            .config
            .file_stem()
            .map(|s| s.to_string_lossy().to_string())
            .unwrap_or_else(|| "run".into());
        PathBuf::from("runs").join(name)
    });
    let overrides = args
        .overrides
        .iter()
        .map(|text| text.parse::<Override>())
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let task = ember_train::config::task_of(&args.config)?;
    let init_from = match &args.init_from {
        Some(_) if task == "translation" => {
            bail!("--init-from starts language models; this config trains a translation model")
        }
        Some(dir) => Some(InitFrom::new(dir, &args.config)?),
        None => None,
    };
    let launch = Launch {
        out_dir: out.clone(),
        resume: args.resume,
        overwrite: args.overwrite,
        device: args.device,
        stop_after: args.stop_after,
        no_checkpoints: args.no_checkpoints,
        progress: std::io::stderr().is_terminal(),
        init_from,
        interrupt: Some(crate::signals::stop_on_signals()),
        profile_steps: args.profile_steps,
        ranks: ember_train::distributed::Ranks::from_env()?,
    };
    // Across processes rank 0 alone reports (the others' share is in its lines).
    let main = launch.ranks.as_ref().is_none_or(|r| r.is_main());
    let trained = if task == "translation" {
        let config = TranslationRunConfig::load_with(&args.config, &overrides)?;
        ember_train::train_translation(config, &launch)
    } else {
        ember_train::train_lm(RunConfig::load_with(&args.config, &overrides)?, &launch)
    };
    let summary = match trained {
        Err(TrainError::Interrupted { .. }) if !main => {
            return Ok(ExitCode::from(crate::signals::exit_code()));
        }
        Err(TrainError::Interrupted { step, .. }) if args.no_checkpoints => {
            eprintln!("interrupted at step {step} (--no-checkpoints: nothing saved)");
            return Ok(ExitCode::from(crate::signals::exit_code()));
        }
        Err(TrainError::Interrupted { step, checkpoint }) => {
            eprintln!("interrupted at step {step}: saved {}", checkpoint.display());
            let sets: String = args
                .overrides
                .iter()
                .map(|o| format!(" --set {}", shell_word(o)))
                .collect();
            let how = match &launch.ranks {
                Some(ranks) => format!("{} as before, running ", ranks.launcher),
                None => String::new(),
            };
            eprintln!(
                "continue with: {how}ember train --config {}{sets} --out {} --resume",
                shell_word(&args.config.to_string_lossy()),
                shell_word(&out.to_string_lossy())
            );
            return Ok(ExitCode::from(crate::signals::exit_code()));
        }
        other => other?,
    };
    if !main {
        return Ok(ExitCode::SUCCESS);
    }
    // Where the time outside the steps went: the evaluations and checkpoints of this process.
    let spent: Vec<String> = [
        ("evaluations", summary.evaluations),
        ("checkpoints", summary.checkpoints),
    ]
    .into_iter()
    .filter(|(_, spent)| spent.count > 0)
    .map(|(what, spent)| format!("{} {what} {:.1}s", spent.count, spent.secs))
    .collect();
    eprintln!(
        "done: {} steps in {:.1}s ({:.1} ms/step, {:.0} tokens/s){}{}",
        summary.step,
        summary.elapsed_secs,
        summary.ms_per_step,
        summary.tokens_per_sec,
        summary
            .val_loss
            .map(|v| format!(", val loss {v:.4}"))
            .unwrap_or_default(),
        match spent.is_empty() {
            true => String::new(),
            false => format!("; of which {}", spent.join(", ")),
        }
    );
    if let Some(peak) = peak_memory() {
        eprintln!("peak memory: {peak}");
    }
    if let Some(memory) = &summary.device_memory {
        eprintln!("GPU memory: {memory}");
    }
    if let Some(profile) = &summary.kernel_profile {
        eprint!("{profile}");
    }
    match args.no_checkpoints {
        true => eprintln!("checkpoint: none (--no-checkpoints)"),
        false => eprintln!("checkpoint: {}", summary.checkpoint.display()),
    }
    if let Some((best, loss)) = &summary.best {
        eprintln!(
            "best: {} (val loss {loss:.4}; --best picks it)",
            best.display()
        );
    }
    eprintln!(
        "metrics: {}, plot: {}",
        out.join("metrics.jsonl").display(),
        out.join("loss.png").display()
    );
    Ok(ExitCode::SUCCESS)
}

/// `word` quoted for a POSIX shell when it needs to be.
fn shell_word(word: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c);
    if !word.is_empty() && word.chars().all(plain) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}

/// Peak resident memory of this process, from /proc (Linux only).
fn peak_memory() -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(format!("{:.0} MiB", kb / 1024.0))
}
