//! Language modelling: a corpus, a tokenizer, random windows, and a [`DecoderOnly`] model.

use std::path::Path;

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor};
use ember_data::{
    CharTokenizer, TokenFile, Tokenizer, WindowSampler, batch_seed, corpus, token_file,
};
use ember_infer::summed_losses;
use ember_model::DecoderOnly;

use crate::checkpoint::CONFIG_FILE;
use crate::config::{RunConfig, TokenizerKind};
use crate::conversation::Conversation;
use crate::error::{Result, TrainError, write_err};
use crate::lm_source::{LmSource, open_lm};
use crate::memory;
use crate::task::{Split, Task};
use crate::trainer::{Launch, RunSummary};

/// Seed salt for evaluation batches: fixed, so every evaluation sees the same windows.
const EVAL_SALT: u64 = 0xE7A1;

/// A tokenized corpus split for training.
pub struct LmData {
    /// The tokenizer built from (or for) the corpus.
    pub tokenizer: Tokenizer,
    /// Training windows.
    pub train: WindowSampler,
    /// Validation windows.
    pub val: WindowSampler,
    /// Characters (or pieces) of the corpus outside the vocabulary.
    pub unknown: usize,
}

/// The largest text file `ember train` tokenizes itself (64 MiB): a larger one is prepared
/// once with `ember prepare` (tokenizing a 111 MB file in memory with a BPE took 12 GB).
pub const TEXT_LIMIT: u64 = 64 << 20;

/// Builds the tokenizer the config asks for, tokenizes the corpus and splits it; or, where
/// `data.path` is a prepared corpus folder (`ember prepare`), maps its token file.
pub fn prepare(config: &RunConfig, tokenizer: Option<Tokenizer>) -> Result<LmData> {
    let path = &config.data.path;
    crate::config::must_exist("data.path", path)?;
    if let Some(file) = &config.data.tokenizer_file {
        crate::config::must_exist("data.tokenizer_file", file)?;
    }
    if token_file::is_prepared(path) {
        return prepared(config, tokenizer);
    }
    if path.is_dir() {
        return Err(TrainError::ConfigValue {
            key: "data.path".into(),
            message: format!(
                "= {}: a folder without {}; a folder of text files is tokenized once with \
                 `ember prepare {} --out DIR`, and data.path set to DIR",
                path.display(),
                token_file::TOKENS_FILE,
                path.display()
            ),
        });
    }
    if let Ok(meta) = std::fs::metadata(path)
        && meta.is_file()
        && meta.len() > TEXT_LIMIT
    {
        return Err(TrainError::ConfigValue {
            key: "data.path".into(),
            message: format!(
                "= {}: {} MB of text, more than ember tokenizes at the start of a run ({} MB); \
                 tokenize it once with `ember prepare {} --out DIR` (with the run's tokenizer \
                 settings, e.g. --tokenizer bpe --vocab-size N) and set data.path to DIR",
                path.display(),
                meta.len() >> 20,
                TEXT_LIMIT >> 20,
                path.display()
            ),
        });
    }
    let text = corpus::read_text(path)?;
    let tokenizer = match tokenizer {
        Some(t) => t,
        None => build_tokenizer(config, &text)?,
    };
    let encoded = tokenizer.encode(&text)?;
    let (train, val) = corpus::split(&encoded.ids, config.data.train_fraction);
    let context = config.model.context_len;
    let name = |split: &str| format!("the {split} split of {}", path.display());
    Ok(LmData {
        train: WindowSampler::new(&name("training"), train.to_vec(), context)?,
        val: WindowSampler::new(&name("validation"), val.to_vec(), context)?,
        tokenizer,
        unknown: encoded.unknown,
    })
}

/// A prepared corpus: the folder's tokenizer (which must be the kind the config names, and a
/// resumed or fine-tuned run's own), its token file mapped and split as a text is.
fn prepared(config: &RunConfig, tokenizer: Option<Tokenizer>) -> Result<LmData> {
    let data = &config.data;
    let folder = &data.path;
    let theirs = token_file::load_folder_tokenizer(folder)?;
    let mismatch = |message: String| TrainError::ConfigValue {
        key: "data.tokenizer".into(),
        message,
    };
    let wanted_char = data.tokenizer_file.is_none() && data.tokenizer == TokenizerKind::Char;
    if wanted_char != theirs.is_char() {
        return Err(mismatch(format!(
            "asks for {} but {} was prepared with {}; prepare it again with the run's tokenizer \
             or set data.tokenizer to match",
            if wanted_char { "char" } else { "bpe" },
            folder.display(),
            theirs.describe()
        )));
    }
    if let Some(file) = &data.tokenizer_file {
        let named = Tokenizer::Bpe(Box::new(ember_data::bpe::load_bpe(file)?));
        if token_file::tokenizer_hash(&named) != token_file::tokenizer_hash(&theirs) {
            return Err(mismatch(format!(
                "data.tokenizer_file {} is not the tokenizer {} was prepared with; prepare it \
                 again with --tokenizer-file",
                file.display(),
                folder.display()
            )));
        }
    }
    // A resumed or fine-tuned run keeps its own tokenizer: the token file must be its ids.
    let tokenizer = tokenizer.unwrap_or(theirs);
    let file = TokenFile::open(folder, &tokenizer)?;
    let n = file.len();
    let split = ((n as f64) * data.train_fraction) as usize;
    let split = split.min(n);
    let context = config.model.context_len;
    let name = |s: &str| format!("the {s} split of {}", file.path.display());
    Ok(LmData {
        train: WindowSampler::mapped(&name("training"), file.clone(), 0..split, context)?,
        val: WindowSampler::mapped(&name("validation"), file, split..n, context)?,
        tokenizer,
        unknown: 0,
    })
}

fn build_tokenizer(config: &RunConfig, text: &str) -> Result<Tokenizer> {
    let data = &config.data;
    Ok(match (data.tokenizer, &data.tokenizer_file) {
        (_, Some(file)) => Tokenizer::Bpe(Box::new(ember_data::bpe::load_bpe(file)?)),
        (TokenizerKind::Char, None) => Tokenizer::Char(CharTokenizer::from_text(text)),
        (TokenizerKind::Bpe, None) => Tokenizer::Bpe(Box::new(ember_data::bpe::train_bpe(
            &[data.path.as_path()],
            data.bpe_vocab_size,
            &[],
        )?)),
    })
}

/// The language-modelling task for the training loop.
pub struct LmTask {
    /// Data and tokenizer.
    pub data: LmData,
    /// What the model it started from says of conversation, kept in every checkpoint: its
    /// chat template, and the ids that end its texts (`eos_token_id`s).
    pub conversation: Conversation,
    /// The resolved config (saved in checkpoints).
    pub config: RunConfig,
    /// The compute device without autodiff.
    pub device: Device,
}

impl LmTask {
    fn batch(&self, split: Split, seed: u64, device: &Device) -> (Tensor<2, Int>, Tensor<2, Int>) {
        let sampler = match split {
            Split::Train => &self.data.train,
            Split::Val => &self.data.val,
        };
        let t = self.config.model.context_len;
        let b = self.config.training.batch_size;
        let batch = sampler.sample(b, seed);
        let x = Tensor::<1, Int>::from_ints(batch.inputs.as_slice(), device).reshape([b, t]);
        let y = Tensor::<1, Int>::from_ints(batch.targets.as_slice(), device).reshape([b, t]);
        (x, y)
    }
}

impl Task for LmTask {
    type Model = DecoderOnly;

    fn train_loss(
        &self,
        model: &DecoderOnly,
        step: u64,
        micro: u64,
        _micros: u64,
        device: &Device,
    ) -> (Tensor<1>, usize) {
        let seed = batch_seed(self.config.training.seed, step, micro);
        let (x, y) = self.batch(Split::Train, seed, device);
        let tokens = x.dims()[0] * x.dims()[1];
        (model.loss(x, y), tokens)
    }

    /// The mean loss over `batches` batches of `split` (the same batches at every evaluation),
    /// summed on the device and read once: evaluation is forward passes only, and a GPU would
    /// otherwise wait for the host to read each batch's loss before the next is launched. On GPU
    /// backends one captured pass is replayed per batch ([`ember_infer::summed_losses`]).
    /// (Stacking several batches into one pass was also tried: on an H200 it shortened the
    /// evaluations but the process's GPU memory doubled; docs/benchmarks.md.)
    fn eval_loss(&self, model: &DecoderOnly, split: Split, batches: usize) -> f64 {
        let sampler = match split {
            Split::Train => &self.data.train,
            Split::Val => &self.data.val,
        };
        let shape = [
            self.config.training.batch_size,
            self.config.model.context_len,
        ];
        let batch = |i: usize| {
            let seed = batch_seed(
                self.config.training.seed ^ EVAL_SALT,
                i as u64,
                split as u64,
            );
            let batch = sampler.sample(shape[0], seed);
            (batch.inputs, batch.targets)
        };
        let loss = |x, y| model.loss(x, y);
        // No batches: 0 / 0, NaN.
        summed_losses(&self.device, shape, batches, batch, loss).sum / batches as f64
    }

    fn write_files(&self, dir: &Path) -> Result<()> {
        self.data.tokenizer.save(dir)?;
        self.conversation.save(dir)?;
        let path = dir.join(CONFIG_FILE);
        std::fs::write(&path, self.config.to_toml()).map_err(|e| write_err(&path, e))
    }

    fn model_kind(&self) -> &'static str {
        "decoder_only"
    }
}

/// The tokenizer and model a run starts from, other than a fresh one: on resume the
/// checkpoint's (so ids mean the same thing, and `config.model` becomes the saved one); with
/// `--init-from` another model's architecture, weights and tokenizer. With them, what the folder
/// they come from says of conversation.
fn model_source(
    config: &mut RunConfig,
    launch: &Launch,
) -> Result<(Option<Tokenizer>, Option<LmSource>, Conversation)> {
    if launch.resume {
        let saved = open_lm(&launch.out_dir)?;
        let mut ours = config.model.clone();
        ours.vocab_size = saved.config.model.vocab_size;
        crate::config::note_kept_model(&saved.dir, &saved.config.model, &ours);
        config.model = saved.config.model;
        let conversation = Conversation::of_folder(&saved.dir)?;
        Ok((Some(saved.tokenizer), None, conversation))
    } else if let Some(init) = &launch.init_from {
        let opened = open_lm(&init.dir)?;
        config.model = init.model_config(&opened.config.model)?;
        eprintln!(
            "starting from {} (its architecture and tokenizer)",
            opened.dir.display()
        );
        let conversation = Conversation::of_folder(&opened.dir)?;
        Ok((Some(opened.tokenizer.clone()), Some(opened), conversation))
    } else {
        Ok((None, None, Conversation::default()))
    }
}

/// Everything `ember train` does for a language model: prepare data, build (or resume) the
/// model, train, and report. `config.model.vocab_size` is set from the tokenizer.
pub fn train_lm(mut config: RunConfig, launch: &Launch) -> Result<RunSummary> {
    let fingerprint = crate::distributed::fingerprint(&config.to_toml());
    let claimed = launch.claim(&mut config.training, fingerprint)?;
    let main = claimed.is_main();
    let device = claimed.devices[0].clone();
    let out_dir = launch.out_dir.clone();
    let (tokenizer, source, conversation) = model_source(&mut config, launch)?;
    let data = prepare(&config, tokenizer)?;
    if data.unknown > 0 && main {
        eprintln!(
            "note: {} characters of {} are outside the vocabulary (mapped to unknown)",
            data.unknown,
            config.data.path.display()
        );
    }
    if !launch.resume && source.is_none() {
        config.model.vocab_size = data.tokenizer.vocab_size();
    }
    config.validate()?;
    if main {
        eprintln!("resolved config:\n{}", config.to_toml());
        if let Some(world) = &claimed.world {
            let t = &config.training;
            let sequences = t.batch_size * t.grad_accum * world.size();
            eprintln!(
                "global batch: batch_size {} x grad_accum {} x {} processes = {sequences} \
                 sequences of {} tokens",
                t.batch_size,
                t.grad_accum,
                world.size(),
                config.model.context_len
            );
        }
        eprintln!(
            "data: {} ({} train tokens, {} val tokens, tokenizer {})",
            config.data.path.display(),
            data.train.len(),
            data.val.len(),
            data.tokenizer.describe()
        );
        std::fs::create_dir_all(&out_dir).map_err(|e| write_err(&out_dir, e))?;
        let config_path = out_dir.join(CONFIG_FILE);
        std::fs::write(&config_path, config.to_toml()).map_err(|e| write_err(&config_path, e))?;
    }

    let train_device = device.clone().autodiff();
    ember_kernels::seed_random(&train_device, config.training.seed);
    let model = match &source {
        Some(source) => source.load_model(&config.model, &train_device)?,
        None => config.model.init(&train_device)?,
    };
    if main {
        eprintln!("{}", model.summary());
    }
    let m = &config.model;
    let t = &config.training;
    let needs = memory::Needs {
        params: model.num_params(),
        loaded: source.is_some(),
        moments_in_forward: launch.resume || launch.last_step(t.max_steps) > 1,
        activations: memory::activation_bytes(
            (t.batch_size as u64).saturating_mul(m.context_len as u64),
            m.n_layers,
            m.d_model,
            // A gated MLP keeps its double-width expansion and the gated product.
            if m.gated_mlp { 3 * m.d_ff() } else { m.d_ff() },
            m.vocab_size,
            t.precision.product_bytes(),
        ),
        devices: memory::cpu_devices(&claimed.devices),
        batch: format!(
            "training.batch_size = {} x model.context_len = {} tokens",
            t.batch_size, m.context_len
        ),
        keys: "model.d_model, model.n_layers, model.d_ff, the vocabulary or training.batch_size"
            .into(),
    };
    memory::check_run(&needs)?;
    let title = format!(
        "decoder-only LM on {}",
        config
            .data
            .path
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default()
    );
    let (options, folder) = claimed.run_options(launch, config.training.clone(), title);
    let task = LmTask {
        data,
        conversation,
        config,
        device,
    };
    let summary = crate::trainer::train(&task, model, &options);
    drop(folder);
    summary
}
