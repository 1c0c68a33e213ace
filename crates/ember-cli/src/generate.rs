//! `ember generate`

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Result, bail};
use clap::Args;
use ember_infer::{GenerateOptions, Sampling, generate};

use crate::stream::Stream;

/// Arguments of `ember generate`.
#[derive(Args)]
pub struct GenerateArgs {
    /// Text to continue.
    #[arg(long)]
    prompt: String,
    /// Checkpoint folder, or a run folder (its newest checkpoint).
    #[arg(long, value_name = "DIR", default_value = "runs/small")]
    checkpoint: PathBuf,
    /// With a run folder: its best checkpoint (lowest validation loss) instead of the newest.
    #[arg(long)]
    best: bool,
    /// Tokens to generate per sample.
    #[arg(long, value_name = "N", default_value_t = 500)]
    max_tokens: usize,
    /// Sampling temperature: lower is more conservative.
    #[arg(long, value_name = "T", default_value_t = 0.8)]
    temperature: f32,
    /// Sample only among the K most likely tokens.
    #[arg(long, value_name = "K")]
    top_k: Option<usize>,
    /// Sample only among the most likely tokens covering probability P.
    #[arg(long, value_name = "P")]
    top_p: Option<f32>,
    /// Seed of the sampler; the same seed gives the same text.
    #[arg(long, value_name = "S", default_value_t = 1337)]
    seed: u64,
    /// Always take the most likely token.
    #[arg(long)]
    greedy: bool,
    /// Stop a sample when this text appears (it is not printed).
    #[arg(long, value_name = "STR")]
    stop: Option<String>,
    /// Independent samples to draw.
    #[arg(long, value_name = "N", default_value_t = 1)]
    num_samples: usize,
    /// Compute device: flex (CPU), ndarray, wgpu, vulkan, cuda[:N] (GPU ones need their cargo
    /// feature), or auto (a GPU if one answers, else flex).
    #[arg(long, value_name = "NAME", default_value = "flex")]
    device: String,
    /// Recompute the whole window for every token instead of using the KV cache.
    #[arg(long)]
    no_cache: bool,
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let checkpoint = crate::chosen_checkpoint(&args.checkpoint, args.best)?;
    if args.prompt.is_empty() {
        bail!("--prompt is empty: give some text to continue, e.g. --prompt \"ROMEO:\"");
    }
    if !(args.temperature.is_finite() && args.temperature >= 0.0) {
        bail!(
            "--temperature must be zero or positive, got {}",
            args.temperature
        );
    }
    if let Some(p) = args.top_p
        && !(p > 0.0 && p <= 1.0)
    {
        bail!("--top-p must be in (0, 1], got {p}");
    }
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1, got 0");
    }
    if args.top_k == Some(0) {
        bail!("--top-k must be at least 1, got 0");
    }
    let device = ember_train::device::parse(&args.device)?;
    let lm = ember_train::load_lm(&checkpoint, &device)?;
    let encoded = lm.tokenizer.encode(&args.prompt)?;
    if encoded.unknown > 0 {
        eprintln!(
            "note: {} character(s) of the prompt are not in the model's vocabulary (mapped to unknown)",
            encoded.unknown
        );
    }
    let context = lm.config.model.context_len;
    if encoded.ids.len() > context {
        eprintln!(
            "note: the prompt has {} tokens; the model sees only the last {context}",
            encoded.ids.len()
        );
    }
    let options = GenerateOptions {
        max_new_tokens: args.max_tokens,
        sampling: Sampling {
            greedy: args.greedy,
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
        },
        seed: args.seed,
        use_cache: !args.no_cache,
        context_len: context,
    };
    eprintln!("checkpoint {} (step {})", lm.dir.display(), lm.step);
    let mut total_tokens = 0;
    let start = Instant::now();
    for sample in 0..args.num_samples {
        if sample > 0 {
            println!("\n---------------");
        }
        print!("{}", args.prompt);
        let mut stream = Stream::new(&lm.tokenizer, args.stop.as_deref());
        let opts = GenerateOptions {
            seed: args.seed.wrapping_add(sample as u64),
            ..options
        };
        let ids = generate(&lm.model, &encoded.ids, &opts, |id| stream.push(id));
        stream.finish();
        total_tokens += ids.len();
        println!();
    }
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "{total_tokens} tokens in {secs:.2}s ({:.0} tokens/s, {})",
        total_tokens as f64 / secs.max(1e-9),
        if args.no_cache {
            "no KV cache"
        } else {
            "KV cache"
        }
    );
    Ok(())
}
