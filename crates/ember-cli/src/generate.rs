//! `ember generate`

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use ember_infer::{Decoding, GenerateOptions, Sampling, generate_batch, generate_reporting};

use crate::stream::Stream;

/// Arguments of `ember generate`.
#[derive(Args)]
pub struct GenerateArgs {
    /// Text to continue; `-` reads it from standard input, `FILE:path` from a file (nanoGPT's
    /// convention).
    #[arg(
        long,
        required_unless_present = "prompt_file",
        conflicts_with = "prompt_file"
    )]
    prompt: Option<String>,
    /// Several prompts, one per line (`-`: standard input): continued together in batches of
    /// `--batch-size`, each printed whole, separated by a line of dashes.
    #[arg(long, value_name = "FILE")]
    prompt_file: Option<PathBuf>,
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
    /// Penalise tokens already in the text (Hugging Face's definition: positive logits divided
    /// by P, negative ones multiplied); 1 is off, 1.1-1.3 is typical.
    #[arg(long, value_name = "P", default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Seed of the sampler; the same seed gives the same text.
    #[arg(long, value_name = "S", default_value_t = 1337)]
    seed: u64,
    /// Always take the most likely token.
    #[arg(long)]
    greedy: bool,
    /// Stop a sample when this text appears (it is not printed); repeatable.
    #[arg(long, value_name = "STR")]
    stop: Vec<String>,
    /// Go on past the tokenizer's end-of-text token (e.g. GPT-2's `<|endoftext|>`, and those a
    /// Hugging Face folder's `eos_token_id` lists) instead of stopping there.
    #[arg(long)]
    ignore_eot: bool,
    /// The prompt is a user's message to an instruction-tuned model: laid out by the
    /// checkpoint's chat template (`chat_template.jinja` or `tokenizer_config.json`'s, as
    /// transformers' `apply_chat_template` lays it out), the reply alone printed.
    #[arg(long)]
    chat: bool,
    /// With `--chat`: a system message before the user's.
    #[arg(long, value_name = "TEXT", requires = "chat")]
    system: Option<String>,
    /// Print only the continuation, not the prompt before it.
    #[arg(long)]
    no_echo: bool,
    /// Independent samples to draw.
    #[arg(long, value_name = "N", default_value_t = 1)]
    num_samples: usize,
    /// Samples generated together in one batch (each prompt of `--prompt-file` times
    /// `--num-samples`, prompts left-padded to one length); 1 continues them one at a time,
    /// streaming each as it comes.
    #[arg(long, value_name = "N", default_value_t = 8)]
    batch_size: usize,
    /// Compute device: flex (CPU), ndarray, wgpu, vulkan, cuda[:N] (GPU ones need their cargo
    /// feature), or auto (a GPU if one answers, else flex).
    #[arg(long, value_name = "NAME", default_value = "flex")]
    device: String,
    /// Recompute the whole window for every token instead of using the KV cache.
    #[arg(long)]
    no_cache: bool,
}

/// The prompts to continue: `--prompt` (text, `-` or `FILE:path`) or `--prompt-file`'s lines.
fn prompts(args: &GenerateArgs) -> Result<Vec<String>> {
    let read = |path: &Path| -> Result<String> {
        if path == Path::new("-") {
            let mut text = String::new();
            std::io::stdin()
                .read_to_string(&mut text)
                .context("cannot read the prompt from standard input")?;
            Ok(text)
        } else {
            std::fs::read_to_string(path)
                .with_context(|| format!("cannot read prompt file {}", path.display()))
        }
    };
    if let Some(file) = &args.prompt_file {
        let text = read(file)?;
        let lines: Vec<String> = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect();
        if lines.is_empty() {
            bail!("--prompt-file {} has no non-empty line", file.display());
        }
        return Ok(lines);
    }
    let prompt = args.prompt.as_deref().unwrap_or_default();
    let text = if prompt == "-" {
        read(Path::new("-"))?
    } else if let Some(path) = prompt.strip_prefix("FILE:") {
        read(Path::new(path))?
    } else {
        prompt.to_string()
    };
    if text.is_empty() {
        bail!("--prompt is empty: give some text to continue, e.g. --prompt \"ROMEO:\"");
    }
    Ok(vec![text])
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let checkpoint = crate::chosen_checkpoint(&args.checkpoint, args.best)?;
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
    if !(args.repetition_penalty.is_finite() && args.repetition_penalty > 0.0) {
        bail!(
            "--repetition-penalty must be a positive number (1 is off), got {}",
            args.repetition_penalty
        );
    }
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1, got 0");
    }
    if args.top_k == Some(0) {
        bail!("--top-k must be at least 1, got 0");
    }
    if args.batch_size == 0 {
        bail!("--batch-size must be at least 1, got 0");
    }
    if args.stop.iter().any(String::is_empty) {
        bail!("--stop is empty: give the text at which a sample stops");
    }
    if args.num_samples == 0 {
        bail!("--num-samples must be at least 1, got 0");
    }
    let prompts = prompts(&args)?;
    let device = ember_train::device::parse(&args.device)?;
    let lm = ember_train::load_lm(&checkpoint, &device)?;
    let context = lm.config.model.context_len;
    let template = match args.chat {
        true => Some(
            ember_data::chat::ChatTemplate::of_folder(&lm.dir)?.with_context(|| {
                format!(
                    "{} has no chat template ({} or {}'s chat_template): --chat needs an \
                 instruction-tuned model's",
                    lm.dir.display(),
                    ember_data::chat::CHAT_TEMPLATE_FILE,
                    ember_data::chat::TOKENIZER_CONFIG
                )
            })?,
        ),
        false => None,
    };
    // Where a sample ends (unless `--ignore-eot`): the tokenizer's end-of-text token, the
    // folder's `eos_token_id`s, the chat template's end-of-turn token.
    let mut end_of_text = Vec::new();
    if !args.ignore_eot {
        end_of_text.extend(lm.tokenizer.end_of_text_id());
        end_of_text.extend(ember_train::hf::end_ids(&lm.dir)?);
        end_of_text.extend(
            template
                .as_ref()
                .and_then(|t| lm.tokenizer.id_of(t.eos_token())),
        );
    }
    let options = GenerateOptions {
        max_new_tokens: args.max_tokens,
        sampling: Sampling {
            greedy: args.greedy,
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            repetition_penalty: args.repetition_penalty,
        },
        seed: args.seed,
        use_cache: !args.no_cache,
        context_len: context,
    };
    eprintln!("checkpoint {} (step {})", lm.dir.display(), lm.step);
    // One row per prompt and sample, each with its own seed, made a batch at a time (many
    // samples of one prompt are not all held at once).
    let encoded = prompts
        .iter()
        .map(|prompt| {
            let ids = match &template {
                // The template writes the special tokens itself (its `bos_token`).
                Some(template) => {
                    let text = chat_prompt(template, args.system.as_deref(), prompt)?;
                    encode(&lm.tokenizer, &text, context, false)?
                }
                None => encode(&lm.tokenizer, prompt, context, true)?,
            };
            Ok((prompt.as_str(), ids))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut rows = encoded.iter().flat_map(|(prompt, ids)| {
        (0..args.num_samples).map(move |sample| Row {
            prompt,
            ids: ids.clone(),
            seed: args.seed.wrapping_add(sample as u64),
        })
    });
    let start = Instant::now();
    let mut total_tokens = 0;
    // How the last sample streamed one at a time was decoded (batches say nothing).
    let mut decoding: Option<Decoding> = None;
    for n in 0.. {
        let chunk: Vec<Row> = rows.by_ref().take(args.batch_size).collect();
        if chunk.is_empty() {
            break;
        }
        if n > 0 {
            println!("\n---------------");
        }
        total_tokens += if chunk.len() == 1 {
            let (tokens, how) = stream_one(&lm, &chunk[0], &args, &options, &end_of_text);
            decoding = Some(how);
            tokens
        } else {
            decoding = None;
            print_batch(&lm, &chunk, &args, &options, &end_of_text)
        };
    }
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "{total_tokens} tokens in {secs:.2}s ({:.0} tokens/s, {}{})",
        total_tokens as f64 / secs.max(1e-9),
        if args.no_cache {
            "no KV cache"
        } else {
            "KV cache"
        },
        decoding.map_or(String::new(), |how| format!("; {how}"))
    );
    Ok(())
}

/// One sample to generate: its prompt, the prompt's ids and the sampler's seed.
struct Row<'a> {
    prompt: &'a str,
    ids: Vec<u32>,
    seed: u64,
}

/// `prompt` as a user's message (after `system`'s, if any) laid out by `template`, opening the
/// assistant's reply.
fn chat_prompt(
    template: &ember_data::chat::ChatTemplate,
    system: Option<&str>,
    prompt: &str,
) -> Result<String> {
    use ember_data::chat::Message;
    let system = system.map(|text| Message::new("system", text));
    let messages: Vec<Message> = system
        .into_iter()
        .chain([Message::new("user", prompt)])
        .collect();
    Ok(template.render(&messages, true)?)
}

/// The prompt's ids (with what the tokenizer puts before a prompt where `special`), with a note
/// on stderr for unknown characters or a prompt longer than the context.
fn encode(
    tokenizer: &ember_data::Tokenizer,
    prompt: &str,
    context: usize,
    special: bool,
) -> Result<Vec<u32>> {
    let encoded = match special {
        true => tokenizer.encode_prompt(prompt)?,
        false => tokenizer.encode(prompt)?,
    };
    if encoded.ids.is_empty() {
        bail!("the prompt {prompt:?} encodes to no tokens");
    }
    if encoded.unknown > 0 {
        eprintln!(
            "note: {} character(s) of the prompt are not in the model's vocabulary (mapped to unknown)",
            encoded.unknown
        );
    }
    if encoded.ids.len() > context {
        eprintln!(
            "note: the prompt has {} tokens; the model sees only the last {context}",
            encoded.ids.len()
        );
    }
    Ok(encoded.ids)
}

/// Generates one sample, printing it as it comes; returns the tokens generated and how they
/// were decoded.
fn stream_one(
    lm: &ember_train::LoadedLm,
    row: &Row,
    args: &GenerateArgs,
    options: &GenerateOptions,
    end_of_text: &[u32],
) -> (usize, Decoding) {
    if !args.no_echo && !args.chat {
        print!("{}", row.prompt);
    }
    let mut stream = Stream::new(&lm.tokenizer, &args.stop).after(&row.ids);
    let opts = GenerateOptions {
        seed: row.seed,
        ..*options
    };
    let (ids, decoding) = generate_reporting(&lm.model, &row.ids, &opts, |id| {
        !end_of_text.contains(&id) && stream.push(id)
    });
    stream.finish();
    println!();
    (ids.len(), decoding)
}

/// Generates several samples as one batch and prints each whole, separated; returns the tokens
/// generated.
fn print_batch(
    lm: &ember_train::LoadedLm,
    rows: &[Row],
    args: &GenerateArgs,
    options: &GenerateOptions,
    end_of_text: &[u32],
) -> usize {
    let mut streams: Vec<Stream> = rows
        .iter()
        .map(|row| Stream::silent(&lm.tokenizer, &args.stop).after(&row.ids))
        .collect();
    let prompts: Vec<Vec<u32>> = rows.iter().map(|r| r.ids.clone()).collect();
    let seeds: Vec<u64> = rows.iter().map(|r| r.seed).collect();
    let ids = generate_batch(&lm.model, &prompts, &seeds, options, |i, id| {
        !end_of_text.contains(&id) && streams[i].push(id)
    });
    for (i, (row, stream)) in rows.iter().zip(&mut streams).enumerate() {
        stream.finish();
        if i > 0 {
            println!("\n---------------");
        }
        if !args.no_echo && !args.chat {
            print!("{}", row.prompt);
        }
        print!("{}", stream.text);
        println!();
    }
    ids.iter().map(Vec::len).sum()
}
