//! Translation: a parallel corpus, BPE vocabularies with `<pad> <bos> <eos> <unk>`, batches of
//! similar-length pairs, and an [`EncoderDecoder`] trained with teacher forcing by the same loop
//! as the language model.

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::tensor::{Bool, Device, Int, Tensor};
use ember_data::bleu::corpus_bleu;
use ember_data::bpe::{load_bpe, save_bpe, train_bpe};
use ember_data::parallel::{Bucketed, PAD, PairBatch, SPECIALS, encode_pairs, read_parallel};
use ember_data::{DataError, Tokenizer};
use ember_infer::{SearchOptions, translate_batch};
use ember_model::EncoderDecoder;
use ember_model::loss::cross_entropy;

use crate::checkpoint::CONFIG_FILE;
use crate::error::{Result, TrainError, write_err};
use crate::task::{Split, Task};
use crate::trainer::{Launch, RunSummary};
use crate::translation_config::TranslationRunConfig;

/// File of the shared vocabulary inside a checkpoint.
pub const SHARED_TOKENIZER: &str = "tokenizer.json";
/// Files of separate vocabularies inside a checkpoint.
pub const SRC_TOKENIZER: &str = "src.tokenizer.json";
/// See [`SRC_TOKENIZER`].
pub const TGT_TOKENIZER: &str = "tgt.tokenizer.json";

/// Source and target tokenizers (the same one when the vocabulary is shared).
#[derive(Debug, Clone)]
pub struct Tokenizers {
    /// Tokenizes sources.
    pub src: Tokenizer,
    /// Tokenizes and detokenizes targets.
    pub tgt: Tokenizer,
    /// Whether `src` and `tgt` are one vocabulary.
    pub shared: bool,
}

impl Tokenizers {
    /// One vocabulary for both languages.
    fn shared(tok: Tokenizer) -> Self {
        Self {
            src: tok.clone(),
            tgt: tok,
            shared: true,
        }
    }

    /// Trains byte-level BPE vocabularies on the training files.
    pub fn train(config: &TranslationRunConfig) -> Result<Self> {
        let d = &config.data;
        let bpe = |files: &[&Path]| -> Result<Tokenizer> {
            Ok(Tokenizer::Bpe(Box::new(train_bpe(
                files,
                d.vocab_size,
                &SPECIALS,
            )?)))
        };
        if d.shared_vocab {
            Ok(Self::shared(bpe(&[
                d.train_src.as_path(),
                d.train_tgt.as_path(),
            ])?))
        } else {
            Ok(Self {
                src: bpe(&[d.train_src.as_path()])?,
                tgt: bpe(&[d.train_tgt.as_path()])?,
                shared: false,
            })
        }
    }

    /// Writes the vocabularies into a checkpoint folder.
    pub fn save(&self, dir: &Path) -> Result<()> {
        let save = |tok: &Tokenizer, name: &str| -> Result<()> {
            match tok {
                Tokenizer::Bpe(t) => Ok(save_bpe(t, &dir.join(name))?),
                Tokenizer::Char(_) => unreachable!("translation uses BPE"),
            }
        };
        if self.shared {
            save(&self.src, SHARED_TOKENIZER)
        } else {
            save(&self.src, SRC_TOKENIZER)?;
            save(&self.tgt, TGT_TOKENIZER)
        }
    }

    /// Reads the vocabularies of a checkpoint folder.
    pub fn load(dir: &Path) -> Result<Self> {
        let load = |name: &str| -> Result<Tokenizer> {
            Ok(Tokenizer::Bpe(Box::new(load_bpe(&dir.join(name))?)))
        };
        if dir.join(SHARED_TOKENIZER).is_file() {
            Ok(Self::shared(load(SHARED_TOKENIZER)?))
        } else {
            Ok(Self {
                src: load(SRC_TOKENIZER)?,
                tgt: load(TGT_TOKENIZER)?,
                shared: false,
            })
        }
    }

    /// Source ids of `text`, ending with EOS.
    pub fn encode_source(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = self.src.encode(text)?.ids;
        ids.push(ember_data::parallel::EOS);
        Ok(ids)
    }
}

/// The translation task for the training loop.
pub struct TranslationTask {
    /// The resolved config.
    pub config: TranslationRunConfig,
    /// Vocabularies.
    pub tokenizers: Tokenizers,
    /// Training batches.
    pub train: Bucketed,
    /// Validation batches.
    pub val: Bucketed,
    /// Validation sources (tokenized) and references (raw text) for BLEU.
    pub bleu_set: Vec<(Vec<u32>, String)>,
    /// Device without autodiff.
    pub device: Device,
}

/// Tensors of a batch: source, its padding, decoder input and its padding, decoder output.
type BatchTensors = (
    Tensor<2, Int>,
    Tensor<2, Bool>,
    Tensor<2, Int>,
    Tensor<2, Bool>,
    Tensor<2, Int>,
);

/// A batch's tensors on `device`; on a GPU backend with its widths padded up to a few buckets
/// ([`PairBatch::bucketed`]): each new shape costs a compile and a tuning there, and the masks
/// hide the extra padding (the loss is the same, tested below).
fn tensors(batch: &PairBatch, device: &Device) -> BatchTensors {
    match ember_kernels::on_cubecl(device) {
        true => batch_tensors(&batch.bucketed(), device),
        false => batch_tensors(batch, device),
    }
}

/// A batch's tensors as they are.
fn batch_tensors(batch: &PairBatch, device: &Device) -> BatchTensors {
    let (b, s, t) = (batch.batch_size, batch.src_len, batch.tgt_len);
    let ints = |v: &[i32], w: usize| Tensor::<1, Int>::from_ints(v, device).reshape([b, w]);
    let src = ints(&batch.src, s);
    let tgt_in = ints(&batch.tgt_in, t);
    let tgt_out = ints(&batch.tgt_out, t);
    let src_pad = src.clone().equal_elem(PAD as i64);
    // Decoder inputs are padded where the outputs are (the input is the output shifted right).
    let tgt_pad = tgt_out.clone().equal_elem(PAD as i64);
    (src, src_pad, tgt_in, tgt_pad, tgt_out)
}

impl TranslationTask {
    fn loss(
        &self,
        model: &EncoderDecoder,
        batch: &PairBatch,
        device: &Device,
        smoothing: f64,
    ) -> Tensor<1> {
        let (src, src_pad, tgt_in, tgt_pad, tgt_out) = tensors(batch, device);
        let logits = model.forward(src, Some(src_pad), tgt_in, Some(tgt_pad));
        cross_entropy(logits, tgt_out, Some(PAD), smoothing)
    }
}

impl Task for TranslationTask {
    type Model = EncoderDecoder;

    fn train_loss(
        &self,
        model: &EncoderDecoder,
        step: u64,
        micro: u64,
        micros: u64,
        device: &Device,
    ) -> (Tensor<1>, usize) {
        // The bucketed batches in the order of an epoch: the step's micro-batches over every
        // process are consecutive.
        let index = step * micros + micro;
        let batch = self.train.batch(self.config.training.seed, index);
        (
            self.loss(model, &batch, device, self.config.training.label_smoothing),
            batch.tokens,
        )
    }

    fn eval_loss(&self, model: &EncoderDecoder, split: Split, batches: usize) -> f64 {
        let data = match split {
            Split::Train => &self.train,
            Split::Val => &self.val,
        };
        // Evenly spaced batches of the length-sorted order: short and long sentences alike.
        // Their token-weighted losses are summed on the device and read once (a GPU then never
        // waits for the host between batches).
        let n = batches.min(data.len()).max(1);
        let mut tokens = 0usize;
        let total = (0..n)
            .map(|k| {
                let batch = data.sorted_batch(k * data.len() / n);
                tokens += batch.tokens;
                self.loss(model, &batch, &self.device, 0.0) * batch.tokens as f32
            })
            .reduce(|a, b| a + b);
        match total {
            Some(total) => total.into_scalar::<f32>() as f64 / tokens.max(1) as f64,
            None => f64::NAN,
        }
    }

    fn extra_eval(&self, model: &EncoderDecoder) -> Vec<(String, f64)> {
        if self.bleu_set.is_empty() {
            return Vec::new();
        }
        let hyps = translate_all(
            model,
            &self.tokenizers,
            self.bleu_set.iter().map(|(s, _)| s.clone()).collect(),
            &greedy_options(self.config.data.max_len),
        );
        let refs: Vec<String> = self.bleu_set.iter().map(|(_, r)| r.clone()).collect();
        vec![("val BLEU".into(), corpus_bleu(&hyps, &refs, false).bleu)]
    }

    fn write_files(&self, dir: &Path) -> Result<()> {
        self.tokenizers.save(dir)?;
        let path = dir.join(CONFIG_FILE);
        std::fs::write(&path, self.config.to_toml()).map_err(|e| write_err(&path, e))
    }

    fn model_kind(&self) -> &'static str {
        "encoder_decoder"
    }
}

/// Greedy search settings for sentences of at most `max_len` tokens.
pub fn greedy_options(max_len: usize) -> SearchOptions {
    SearchOptions {
        beam: 1,
        length_penalty: 0.6,
        max_len: max_len + 10,
        bos: ember_data::parallel::BOS,
        eos: ember_data::parallel::EOS,
    }
}

/// Sentences translated per batch.
const SENTENCES_PER_BATCH: usize = 64;

/// Translates tokenized sources in batches (sorted by length, returned in input order).
pub fn translate_all(
    model: &EncoderDecoder,
    tokenizers: &Tokenizers,
    sources: Vec<Vec<u32>>,
    options: &SearchOptions,
) -> Vec<String> {
    let mut order: Vec<usize> = (0..sources.len()).collect();
    order.sort_by_key(|&i| sources[i].len());
    let mut out = vec![String::new(); sources.len()];
    for chunk in order.chunks(SENTENCES_PER_BATCH) {
        let batch: Vec<Vec<u32>> = chunk.iter().map(|&i| sources[i].clone()).collect();
        let hyps = translate_batch(model, &batch, PAD, options);
        for (&i, h) in chunk.iter().zip(hyps) {
            out[i] = tokenizers.tgt.decode(&h.tokens).trim().to_string();
        }
    }
    out
}

fn limit<T>(mut v: Vec<T>, n: Option<usize>) -> Vec<T> {
    if let Some(n) = n {
        v.truncate(n);
    }
    v
}

/// Everything `ember train` does for a translation config.
pub fn train_translation(mut config: TranslationRunConfig, launch: &Launch) -> Result<RunSummary> {
    let fingerprint = crate::distributed::fingerprint(&config.to_toml());
    let claimed = launch.claim(&mut config.training, fingerprint)?;
    let main = claimed.is_main();
    let device = claimed.devices[0].clone();
    let (out_dir, resume) = (launch.out_dir.clone(), launch.resume);
    let d = config.data.clone();
    for (key, path) in [
        ("data.train_src", &d.train_src),
        ("data.train_tgt", &d.train_tgt),
        ("data.val_src", &d.val_src),
        ("data.val_tgt", &d.val_tgt),
    ] {
        crate::config::must_exist(key, path)?;
    }
    let train_pairs = limit(
        read_parallel(&d.train_src, &d.train_tgt)?,
        d.max_train_pairs,
    );
    let val_pairs = read_parallel(&d.val_src, &d.val_tgt)?;
    let tokenizers = if resume {
        // The saved model is the one continued (as a language model's resume does); the
        // vocabulary sizes come from the tokenizers below.
        let dir = crate::checkpoint::resolve(&out_dir)?;
        let saved = TranslationRunConfig::load(&dir.join(CONFIG_FILE))?.model;
        let mut ours = config.model.clone();
        ours.src_vocab_size = saved.src_vocab_size;
        ours.tgt_vocab_size = saved.tgt_vocab_size;
        crate::config::note_kept_model(&dir, &saved, &ours);
        config.model = saved;
        Tokenizers::load(&dir)?
    } else {
        Tokenizers::train(&config)?
    };
    let (train, dropped) = encode_pairs(&train_pairs, &tokenizers.src, &tokenizers.tgt, d.max_len)?;
    let (val, _) = encode_pairs(&val_pairs, &tokenizers.src, &tokenizers.tgt, d.max_len)?;
    let mut bleu_set = Vec::new();
    for (s, t) in val_pairs.iter().take(d.bleu_sentences) {
        let ids = tokenizers.encode_source(s)?;
        if ids.len() <= d.max_len {
            bleu_set.push((ids, t.clone()));
        }
    }
    config.model.src_vocab_size = tokenizers.src.vocab_size();
    config.model.tgt_vocab_size = tokenizers.tgt.vocab_size();
    config.validate()?;
    if main {
        eprintln!("resolved config:\n{}", config.to_toml());
        if let Some(world) = &claimed.world {
            let t = &config.training;
            eprintln!(
                "global batch: about {} tokens x grad_accum {} x {} processes",
                d.batch_tokens,
                t.grad_accum,
                world.size()
            );
        }
    }
    if main {
        eprintln!(
            "data: {} training pairs ({dropped} longer than {} tokens dropped), {} validation pairs; vocabulary {} / {}",
            train.len(),
            d.max_len,
            val.len(),
            tokenizers.src.describe(),
            tokenizers.tgt.describe()
        );
    }
    let empty = |what: &str| {
        TrainError::Data(DataError::Invalid(format!(
            "no {what} pairs left after length filtering (data.max_len = {})",
            d.max_len
        )))
    };
    let train = Bucketed::new(train, d.batch_tokens).map_err(|_| empty("training"))?;
    let val = Bucketed::new(val, d.batch_tokens).map_err(|_| empty("validation"))?;
    if main {
        // An epoch's length in steps (for max_steps and the schedule), and its work.
        let tokens: usize = train.pairs().iter().map(|p| p.tgt.len() + 1).sum();
        eprintln!(
            "batches: {} a training epoch, of at most {} padded tokens ({tokens} target tokens)",
            train.len(),
            d.batch_tokens
        );
    }
    if main {
        std::fs::create_dir_all(&out_dir).map_err(|e| write_err(&out_dir, e))?;
        let config_path = out_dir.join(CONFIG_FILE);
        std::fs::write(&config_path, config.to_toml()).map_err(|e| write_err(&config_path, e))?;
    }

    let train_device = device.clone().autodiff();
    ember_kernels::seed_random(&train_device, config.training.seed);
    let model = config.model.init(&train_device)?;
    if main {
        eprintln!("{}", model.summary());
    }
    // The largest batch's source passes through every encoder layer, its target through every
    // decoder layer and the output layer.
    let m = &config.model;
    let t = &config.training;
    let p = t.precision.product_bytes();
    let (d_model, d_ff) = (m.d_model, m.d_ff());
    let bytes = |(src, tgt): (usize, usize)| {
        crate::memory::activation_bytes(src as u64, m.n_encoder_layers, d_model, d_ff, 0, p)
            + crate::memory::activation_bytes(
                tgt as u64,
                m.n_decoder_layers,
                d_model,
                d_ff,
                m.tgt_vocab_size,
                p,
            )
    };
    let largest = train.padded_tokens().max_by_key(|&tokens| bytes(tokens));
    let (src, tgt) = largest.unwrap_or((0, 0));
    let needs = crate::memory::Needs {
        params: model.num_params(),
        loaded: false,
        moments_in_forward: launch.resume || launch.last_step(t.max_steps) > 1,
        activations: bytes((src, tgt)),
        devices: crate::memory::cpu_devices(&claimed.devices),
        batch: format!(
            "{src} source and {tgt} target tokens padded (the largest batch of \
             data.batch_tokens = {})",
            d.batch_tokens
        ),
        keys: "model.d_model, model.n_encoder_layers, model.n_decoder_layers, model.d_ff, \
               data.vocab_size or data.batch_tokens"
            .into(),
    };
    crate::memory::check_run(&needs)?;
    let title = format!("encoder-decoder on {}", d.train_src.display());
    let (options, folder) = claimed.run_options(launch, config.training.clone(), title);
    let task = TranslationTask {
        config,
        tokenizers,
        train,
        val,
        bleu_set,
        device,
    };
    let summary = crate::trainer::train(&task, model, &options);
    drop(folder);
    summary
}

/// A trained translation model, ready for inference.
pub struct LoadedTranslator {
    /// The model, without autodiff.
    pub model: EncoderDecoder,
    /// Its vocabularies.
    pub tokenizers: Tokenizers,
    /// The config it was trained with.
    pub config: TranslationRunConfig,
    /// The checkpoint folder.
    pub dir: PathBuf,
    /// The step it was saved at.
    pub step: u64,
}

/// Loads a translation checkpoint (or the newest in a run folder).
pub fn load_translator(path: &Path, device: &Device) -> Result<LoadedTranslator> {
    let (dir, state) = crate::checkpoint::open(path, "encoder_decoder", "a translation model")?;
    let config = TranslationRunConfig::load(&dir.join(CONFIG_FILE))?;
    let tokenizers = Tokenizers::load(&dir)?;
    let model = config.model.init(device)?;
    let model = crate::checkpoint::load_model(model, &dir)?;
    Ok(LoadedTranslator {
        model,
        tokenizers,
        config,
        dir,
        step: state.step,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember_data::parallel::{EOS, Pair, make_batch};
    use ember_model::EncoderDecoderConfig;

    /// The loss of a batch padded to bucketed widths equals the loss of the batch as it is:
    /// the extra padding is masked in attention and in the loss (flex, with dropout off).
    #[test]
    fn bucketed_batches_have_the_same_loss() {
        let device = Device::flex();
        let config = EncoderDecoderConfig {
            src_vocab_size: 30,
            tgt_vocab_size: 30,
            d_model: 32,
            n_heads: 4,
            n_encoder_layers: 2,
            n_decoder_layers: 2,
            dropout: 0.0,
            ..Default::default()
        };
        let model = config.init(&device).expect("a valid config");
        let pair = |src: &[u32], tgt: &[u32]| Pair {
            src: src.iter().copied().chain([EOS]).collect(),
            tgt: tgt.to_vec(),
        };
        let pairs = [
            pair(&[5, 9, 12], &[7, 8]),
            pair(&[6, 7, 8, 9, 10, 11], &[13, 14, 15, 16, 17]),
        ];
        let batch = make_batch(&pairs.iter().collect::<Vec<_>>());
        let wide = batch.bucketed();
        assert!(wide.src_len > batch.src_len && wide.tgt_len > batch.tgt_len);
        let loss = |b: &PairBatch| {
            let (src, src_pad, tgt_in, tgt_pad, tgt_out) = batch_tensors(b, &device);
            let logits = model.forward(src, Some(src_pad), tgt_in, Some(tgt_pad));
            cross_entropy(logits, tgt_out, Some(PAD), 0.0).into_scalar::<f32>()
        };
        let (narrow, padded) = (loss(&batch), loss(&wide));
        assert!((narrow - padded).abs() < 1e-5, "{narrow} against {padded}");
    }
}
