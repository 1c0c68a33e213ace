//! Bad input, case by case: every case runs the `ember` binary and must end in one `error:` line
//! naming the problem, a non-zero exit, and no panic or backtrace. The cases and the messages
//! they produce are the table in `docs/errors.md`; this test checks that table is current
//! (`EMBER_BLESS=1 cargo test --release --test errors` rewrites it).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::{ember_ok, repo, temp};

/// `$TMP` in arguments and messages stands for the fixture folder.
const TMP: &str = "$TMP";

struct Case {
    /// Table section.
    area: &'static str,
    /// What is wrong, as the table shows it.
    input: &'static str,
    /// Arguments after `ember`.
    args: &'static [&'static str],
    /// Fed to standard input, if any.
    stdin: Option<&'static str>,
    /// Environment variables set for the run.
    env: &'static [(&'static str, &'static str)],
    /// What the error line must contain (besides what the table records).
    needles: &'static [&'static str],
}

const fn case(
    area: &'static str,
    input: &'static str,
    args: &'static [&'static str],
    needles: &'static [&'static str],
) -> Case {
    Case {
        area,
        input,
        args,
        stdin: None,
        env: &[],
        needles,
    }
}

/// `case` run with the environment variables `env` set (name, value).
const fn with_env(case: Case, env: &'static [(&'static str, &'static str)]) -> Case {
    Case { env, ..case }
}

/// Every bad input the suite covers. Files named here are made by [`fixtures`].
const CASES: &[Case] = &[
    // Configs.
    case(
        "config",
        "missing file",
        &["train", "--config", "$TMP/missing.toml"],
        &["missing.toml", "No such file"],
    ),
    case(
        "config",
        "not TOML",
        &["train", "--config", "$TMP/not-toml.toml"],
        &["not-toml.toml", "line 1"],
    ),
    case(
        "config",
        "unknown key `d_modle`",
        &["train", "--config", "$TMP/unknown-key.toml"],
        &["unknown-key.toml", "line 2", "d_modle"],
    ),
    case(
        "config",
        "wrong type: `d_model = \"big\"`",
        &["train", "--config", "$TMP/wrong-type.toml"],
        &["wrong-type.toml", "line 2", "big"],
    ),
    case(
        "config",
        "unknown task",
        &["train", "--config", "$TMP/task.toml"],
        &["task.toml", "task", "vision"],
    ),
    case(
        "config",
        "zero size: `n_layers = 0`",
        &["train", "--config", "$TMP/zero-layers.toml"],
        &["zero-layers.toml", "n_layers", "0"],
    ),
    case(
        "config",
        "zero size: `batch_size = 0`",
        &["train", "--config", "$TMP/zero-batch.toml"],
        &["zero-batch.toml", "batch_size", "0"],
    ),
    case(
        "config",
        "negative size: `d_model = -4`",
        &["train", "--config", "$TMP/negative.toml"],
        &["negative.toml", "line 2", "-4"],
    ),
    case(
        "config",
        "`n_heads` does not divide `d_model`",
        &["train", "--config", "$TMP/heads.toml"],
        &["heads.toml", "n_heads", "30"],
    ),
    case(
        "config",
        "context longer than the positional table",
        &["train", "--config", "$TMP/context.toml"],
        &["context.toml", "context_len", "64", "32"],
    ),
    case(
        "config",
        "`position_init` for a model without a learned table",
        &["train", "--config", "$TMP/position-init.toml"],
        &["position-init.toml", "position_init", "learned"],
    ),
    case(
        "config",
        "NaN learning rate",
        &["train", "--config", "$TMP/nan-lr.toml"],
        &["nan-lr.toml", "training.lr", "NaN"],
    ),
    case(
        "config",
        "negative learning rate",
        &["train", "--config", "$TMP/negative-lr.toml"],
        &["negative-lr.toml", "training.lr", "-1"],
    ),
    case(
        "config",
        "translation config: unknown key",
        &["train", "--config", "$TMP/mt-unknown.toml"],
        &["mt-unknown.toml", "vocab"],
    ),
    case(
        "config",
        "translation config: `max_train_pairs = 0`",
        &[
            "train",
            "--config",
            "$TMP/mt-misaligned.toml",
            "--set",
            "data.max_train_pairs=0",
        ],
        &["data.max_train_pairs", "at least 1"],
    ),
    // Data.
    case(
        "data",
        "corpus missing",
        &["train", "--config", "$TMP/data-missing.toml"],
        &["data.path", "nope.txt", "no such file"],
    ),
    case(
        "data",
        "corpus empty",
        &["train", "--config", "$TMP/data-empty.toml"],
        &["empty.txt", "empty"],
    ),
    case(
        "data",
        "corpus not UTF-8",
        &["train", "--config", "$TMP/data-binary.toml"],
        &["binary.txt", "UTF-8", "offset 4", "line 2"],
    ),
    case(
        "data",
        "corpus shorter than one context window",
        &["train", "--config", "$TMP/data-short.toml"],
        &["short.txt", "33"],
    ),
    case(
        "data",
        "text corpus too large to tokenize at start-up",
        &["train", "--config", "$TMP/data-huge.toml"],
        &["data.path", "huge.txt", "ember prepare"],
    ),
    case(
        "data",
        "`data.path` a folder that was not prepared",
        &["train", "--config", "$TMP/data-folder.toml"],
        &["data.path", "empty-dir", "ember prepare"],
    ),
    case(
        "data",
        "prepared corpus: token file cut short",
        &["train", "--config", "$TMP/prep-truncated.toml"],
        &["prep-truncated/tokens.bin", "cut short"],
    ),
    case(
        "data",
        "prepared corpus: not a token file",
        &["train", "--config", "$TMP/prep-foreign.toml"],
        &["prep-foreign/tokens.bin", "EMBERTOK"],
    ),
    case(
        "data",
        "prepared corpus: newer format",
        &["train", "--config", "$TMP/prep-newer.toml"],
        &["prep-newer/tokens.bin", "version 99"],
    ),
    case(
        "data",
        "prepared corpus: its tokenizer file replaced",
        &["train", "--config", "$TMP/prep-other-tokenizer.toml"],
        &["prep-other-tokenizer/tokens.bin", "another tokenizer"],
    ),
    case(
        "data",
        "prepared corpus: the config asks for another tokenizer",
        &["train", "--config", "$TMP/prep-bpe.toml"],
        &["data.tokenizer", "bpe", "prepared with char"],
    ),
    case(
        "data",
        "prepared corpus: fine-tuning a model of another tokenizer",
        &[
            "train",
            "--config",
            "$TMP/prep-init.toml",
            "--init-from",
            "crates/ember-train/tests/fixtures/tiny-gpt2",
        ],
        &["prep/tokens.bin", "another tokenizer"],
    ),
    case(
        "data",
        "`prepare` of a file that is not UTF-8",
        &["prepare", "$TMP/binary.txt", "--out", "$TMP/prep-binary"],
        &["binary.txt", "UTF-8", "offset 4", "line 2"],
    ),
    case(
        "data",
        "`prepare` into a run folder",
        &["prepare", "$TMP/short.txt", "--out", "$TMP/run"],
        &["--out $TMP/run", "ember run", "folder of its own"],
    ),
    case(
        "data",
        "`prepare` of a folder with no files",
        &["prepare", "$TMP/empty-dir", "--out", "$TMP/prep-none"],
        &["empty-dir", "no files"],
    ),
    case(
        "data",
        "`prepare --vocab-size` for a character-level tokenizer",
        &[
            "prepare",
            "$TMP/short.txt",
            "--out",
            "$TMP/prep-char",
            "--tokenizer",
            "char",
            "--vocab-size",
            "300",
        ],
        &["--vocab-size 300", "character-level", "--tokenizer bpe"],
    ),
    case(
        "data",
        "parallel files of different lengths",
        &["train", "--config", "$TMP/mt-misaligned.toml"],
        &["three.de", "3", "two.en", "2"],
    ),
    case(
        "data",
        "`eval --data` missing",
        &[
            "eval",
            "--checkpoint",
            "$TMP/run",
            "--data",
            "$TMP/nope.txt",
        ],
        &["nope.txt"],
    ),
    case(
        "data",
        "`eval --data` not UTF-8",
        &[
            "eval",
            "--checkpoint",
            "$TMP/run",
            "--data",
            "$TMP/binary.txt",
        ],
        &["binary.txt", "UTF-8"],
    ),
    case(
        "data",
        "`eval --split` after the training corpus moved",
        &[
            "eval",
            "--checkpoint",
            "$TMP/moved-corpus",
            "--split",
            "val",
        ],
        &["data.path", "moved-corpus/config.toml", "gone.txt"],
    ),
    case(
        "data",
        "`eval --split` of a Hugging Face model",
        &[
            "eval",
            "--checkpoint",
            "crates/ember-train/tests/fixtures/tiny-gpt2",
            "--split",
            "val",
        ],
        &["Hugging Face", "--data"],
    ),
    case(
        "data",
        "`bleu` files of different lengths",
        &["bleu", "--hyp", "$TMP/three.de", "--ref", "$TMP/two.en"],
        &["3", "2"],
    ),
    // Prompts.
    case(
        "prompt",
        "empty prompt",
        &["generate", "--checkpoint", "$TMP/run", "--prompt", ""],
        &["--prompt"],
    ),
    case(
        "prompt",
        "`--max-tokens 0`",
        &[
            "generate",
            "--checkpoint",
            "$TMP/run",
            "--prompt",
            "A",
            "--max-tokens",
            "0",
        ],
        &["--max-tokens"],
    ),
    case(
        "prompt",
        "`--temperature -1`",
        &[
            "generate",
            "--checkpoint",
            "$TMP/run",
            "--prompt",
            "A",
            "--temperature",
            "-1",
        ],
        &["--temperature", "-1"],
    ),
    case(
        "prompt",
        "`--stop ''`",
        &[
            "generate",
            "--checkpoint",
            "$TMP/run",
            "--prompt",
            "A",
            "--stop",
            "",
        ],
        &["--stop is empty"],
    ),
    case(
        "prompt",
        "`--top-p 1.5`",
        &[
            "generate",
            "--checkpoint",
            "$TMP/run",
            "--prompt",
            "A",
            "--top-p",
            "1.5",
        ],
        &["--top-p", "1.5"],
    ),
    case(
        "prompt",
        "`--repetition-penalty 0`",
        &[
            "generate",
            "--checkpoint",
            "$TMP/run",
            "--prompt",
            "A",
            "--repetition-penalty",
            "0",
        ],
        &["--repetition-penalty", "0"],
    ),
    case(
        "prompt",
        "`--batch-size 0`",
        &[
            "generate",
            "--checkpoint",
            "$TMP/run",
            "--prompt",
            "A",
            "--batch-size",
            "0",
        ],
        &["--batch-size", "at least 1"],
    ),
    case(
        "prompt",
        "`--num-samples 0`",
        &[
            "generate",
            "--checkpoint",
            "$TMP/run",
            "--prompt",
            "A",
            "--num-samples",
            "0",
        ],
        &["--num-samples", "at least 1"],
    ),
    case(
        "prompt",
        "`--prompt FILE:` of a missing file",
        &[
            "generate",
            "--checkpoint",
            "$TMP/run",
            "--prompt",
            "FILE:$TMP/nope.txt",
        ],
        &["nope.txt", "No such file"],
    ),
    case(
        "prompt",
        "`--prompt-file` without a prompt",
        &[
            "generate",
            "--checkpoint",
            "$TMP/run",
            "--prompt-file",
            "$TMP/empty.txt",
        ],
        &["empty.txt", "no non-empty line"],
    ),
    // Run folders and command-line overrides.
    case(
        "run folder",
        "`train` into a folder that holds a run",
        &["train", "--config", "$TMP/ok.toml", "--out", "$TMP/run"],
        &["run", "already holds a run", "--resume", "--overwrite"],
    ),
    case(
        "run folder",
        "`--set` of an unknown key",
        &[
            "train",
            "--config",
            "$TMP/ok.toml",
            "--out",
            "$TMP/new-run",
            "--set",
            "training.lrr=1",
        ],
        &["--set training.lrr=1", "unknown field `lrr`"],
    ),
    case(
        "run folder",
        "`--set` without `=`",
        &[
            "train",
            "--config",
            "$TMP/ok.toml",
            "--out",
            "$TMP/new-run",
            "--set",
            "training.lr",
        ],
        &["--set training.lr", "section.key=value"],
    ),
    case(
        "run folder",
        "`--set` of a bad value",
        &[
            "train",
            "--config",
            "$TMP/ok.toml",
            "--out",
            "$TMP/new-run",
            "--set",
            "training.early_stop_patience=0",
        ],
        &["--set training.early_stop_patience=0", "at least 1"],
    ),
    case(
        "run folder",
        "`--set` of key/value heads that do not divide the heads",
        &[
            "train",
            "--config",
            "$TMP/ok.toml",
            "--out",
            "$TMP/new-run",
            "--set",
            "model.n_kv_heads=3",
        ],
        &["n_kv_heads", "= 3", "n_heads = 2"],
    ),
    case(
        "run folder",
        "`--set` of Llama 3's rotary stretch with its frequency bounds reversed",
        &[
            "train",
            "--config",
            "$TMP/ok.toml",
            "--out",
            "$TMP/new-run",
            "--set",
            "model.positional=\"rotary\"",
            "--set",
            "model.rotary_scaling={kind=\"llama3\",factor=8,low_freq_factor=4,\
             high_freq_factor=1,original_max_positions=64}",
        ],
        &[
            "rotary_scaling",
            "`high_freq_factor` (1)",
            "`low_freq_factor` (4)",
        ],
    ),
    case(
        "run folder",
        "`--set` of a precision ember does not have",
        &[
            "train",
            "--config",
            "$TMP/ok.toml",
            "--out",
            "$TMP/new-run",
            "--set",
            "training.precision=\"fp16\"",
        ],
        &["training.precision", "fp16", "`bf16`"],
    ),
    case(
        "run folder",
        "`--profile-steps` on a CPU device",
        &[
            "train",
            "--config",
            "$TMP/ok.toml",
            "--out",
            "$TMP/new-run",
            "--profile-steps",
            "2",
        ],
        &["--profile-steps", "`flex`", "CPU"],
    ),
    case(
        "run folder",
        "`--profile-steps` leaving no step to warm up",
        &[
            "train",
            "--config",
            "$TMP/ok.toml",
            "--out",
            "$TMP/new-run",
            "--profile-steps",
            "500",
        ],
        &["--profile-steps 500", "profile fewer"],
    ),
    // Checkpoints.
    case(
        "checkpoint",
        "`--best` given a checkpoint folder",
        &[
            "generate",
            "--checkpoint",
            "$TMP/run/checkpoints/step-0000020",
            "--best",
            "--prompt",
            "A",
        ],
        &["step-0000020", "--best takes the run folder"],
    ),
    case(
        "checkpoint",
        "missing folder",
        &["generate", "--checkpoint", "$TMP/no-run", "--prompt", "A"],
        &["no-run", "no such folder"],
    ),
    case(
        "checkpoint",
        "a folder with no checkpoint",
        &[
            "generate",
            "--checkpoint",
            "$TMP/empty-dir",
            "--prompt",
            "A",
        ],
        &["empty-dir", "no complete checkpoint"],
    ),
    case(
        "checkpoint",
        "a file, not a folder",
        &[
            "generate",
            "--checkpoint",
            "$TMP/empty.txt",
            "--prompt",
            "A",
        ],
        &["empty.txt", "is a file"],
    ),
    case(
        "checkpoint",
        "truncated weights",
        &[
            "generate",
            "--checkpoint",
            "$TMP/truncated",
            "--prompt",
            "A",
        ],
        &["model.bpk", "cannot load"],
    ),
    case(
        "checkpoint",
        "foreign weights file",
        &["generate", "--checkpoint", "$TMP/foreign", "--prompt", "A"],
        &["model.bpk", "cannot load"],
    ),
    case(
        "checkpoint",
        "foreign state file",
        &[
            "generate",
            "--checkpoint",
            "$TMP/foreign-state",
            "--prompt",
            "A",
        ],
        &["state.json", "not an ember checkpoint"],
    ),
    case(
        "checkpoint",
        "newer format version",
        &["generate", "--checkpoint", "$TMP/newer", "--prompt", "A"],
        &["state.json", "format version 99"],
    ),
    case(
        "checkpoint",
        "weights of another architecture",
        &[
            "eval",
            "--checkpoint",
            "$TMP/other-arch",
            "--data",
            "$TMP/short.txt",
        ],
        &["model.bpk", "wte.weight", "[66, 64]", "[66, 32]"],
    ),
    case(
        "checkpoint",
        "language model given to `translate`",
        &[
            "translate",
            "--checkpoint",
            "$TMP/run",
            "--input",
            "$TMP/short.txt",
        ],
        &["language model", "translation model"],
    ),
    case(
        "checkpoint",
        "`--resume` with nothing to resume",
        &[
            "train",
            "--config",
            "$TMP/ok.toml",
            "--out",
            "$TMP/empty-dir",
            "--resume",
        ],
        &["empty-dir", "no complete checkpoint"],
    ),
    case(
        "checkpoint",
        "Hugging Face folder with `pytorch_model.bin` instead of `model.safetensors`",
        &["generate", "--checkpoint", "$TMP/hf-bin", "--prompt", "A"],
        &[
            "hf-bin",
            "pytorch_model.bin",
            "model.safetensors",
            "save_pretrained",
        ],
    ),
    case(
        "checkpoint",
        "`--chat` with a model that has no chat template",
        &[
            "generate",
            "--checkpoint",
            "$TMP/run",
            "--prompt",
            "Hi",
            "--chat",
        ],
        &["no chat template", "chat_template.jinja", "--chat"],
    ),
    case(
        "checkpoint",
        "Hugging Face folder in shards, one of them missing",
        &[
            "generate",
            "--checkpoint",
            "$TMP/hf-shards",
            "--prompt",
            "A",
        ],
        &[
            "model.safetensors.index.json",
            "`model-00001-of-00002.safetensors`",
            "missing",
        ],
    ),
    case(
        "checkpoint",
        "Hugging Face folder missing a tensor (config.json says 3 layers, weights have 2)",
        &[
            "generate",
            "--checkpoint",
            "$TMP/hf-deeper",
            "--prompt",
            "A",
        ],
        &["model.safetensors", "transformer.h.2.", "missing"],
    ),
    case(
        "checkpoint",
        "Hugging Face Llama folder asking for YaRN's stretched rotation",
        &["generate", "--checkpoint", "$TMP/hf-yarn", "--prompt", "A"],
        &[
            "config.json",
            "rope_parameters",
            "\"yarn\"",
            "\"linear\" and \"llama3\"",
        ],
    ),
    case(
        "checkpoint",
        "Hugging Face folder with a tensor of the wrong shape",
        &[
            "eval",
            "--checkpoint",
            "$TMP/hf-wider",
            "--data",
            "$TMP/short.txt",
        ],
        &[
            "model.safetensors",
            "transformer.wte.weight",
            "[300, 32]",
            "[300, 64]",
        ],
    ),
    case(
        "checkpoint",
        "`--init-from` with an architecture key in `[model]`",
        &[
            "train",
            "--config",
            "$TMP/init-arch.toml",
            "--init-from",
            "$TMP/run",
        ],
        &["init-arch.toml", "model.d_model", "--init-from"],
    ),
    case(
        "checkpoint",
        "`average --last` beyond the checkpoints kept",
        &["average", "$TMP/run", "--last", "3", "--out", "$TMP/avg"],
        &["--last 3", "(2)"],
    ),
    case(
        "checkpoint",
        "`average` of two architectures",
        &[
            "average",
            "$TMP/run/checkpoints/step-0000020",
            "$TMP/other-arch",
            "--out",
            "$TMP/avg",
        ],
        &["other-arch", "[model] config differs"],
    ),
    case(
        "checkpoint",
        "`average --out` an existing run",
        &["average", "$TMP/run", "--out", "$TMP/run"],
        &["run", "already exists"],
    ),
    case(
        "prompt",
        "`translate --length-penalty nan`",
        &[
            "translate",
            "--checkpoint",
            "$TMP/run",
            "--input",
            "$TMP/short.txt",
            "--length-penalty",
            "nan",
        ],
        &["--length-penalty", "NaN"],
    ),
    case(
        "prompt",
        "`translate --max-len 0`",
        &[
            "translate",
            "--checkpoint",
            "$TMP/run",
            "--input",
            "$TMP/short.txt",
            "--max-len",
            "0",
        ],
        &["--max-len", "at least 1"],
    ),
    case(
        "checkpoint",
        "`export --out` a run folder",
        &["export", "--checkpoint", "$TMP/run", "--out", "$TMP/run"],
        &["holds an ember run", "latest", "a folder of its own"],
    ),
    case(
        "checkpoint",
        "a folder holding both a Hugging Face model and a run",
        &[
            "generate",
            "--checkpoint",
            "$TMP/hf-and-run",
            "--prompt",
            "A",
        ],
        &["config.json", "latest", "unclear"],
    ),
    case(
        "run folder",
        "`train` into a Hugging Face folder",
        &[
            "train",
            "--config",
            "$TMP/ok.toml",
            "--out",
            "$TMP/hf-wider",
        ],
        &["hf-wider", "Hugging Face model", "--init-from"],
    ),
    // Devices.
    case(
        "device",
        "unknown device",
        &["train", "--config", "$TMP/ok.toml", "--device", "tpu"],
        &["tpu", "available: flex"],
    ),
    case(
        "device",
        "a GPU device this build lacks",
        &[
            "generate",
            "--checkpoint",
            "$TMP/run",
            "--prompt",
            "A",
            "--device",
            "cuda",
        ],
        &["cuda", "available: flex"],
    ),
    case(
        "device",
        "a device in the config this build lacks",
        &["train", "--config", "$TMP/device.toml"],
        &["wgpu", "available: flex"],
    ),
    case(
        "device",
        "an unknown device in a list of devices",
        &["train", "--config", "$TMP/ok.toml", "--devices", "flex,tpu"],
        &["tpu", "available: flex"],
    ),
    case(
        "device",
        "grad_accum not a multiple of the number of devices",
        &[
            "train",
            "--config",
            "$TMP/ok.toml",
            "--devices",
            "flex,flex",
        ],
        &["training.grad_accum", "multiple of the 2 devices"],
    ),
    case(
        "device",
        "a list of devices given to a one-device command",
        &[
            "generate",
            "--checkpoint",
            "$TMP/run",
            "--prompt",
            "A",
            "--device",
            "flex,flex",
        ],
        &["flex,flex", "one device"],
    ),
    with_env(
        case(
            "device",
            "unknown GPU kernel in `EMBER_GPU_KERNELS`",
            &["train", "--config", "$TMP/ok.toml", "--out", "$TMP/new-run"],
            &["EMBER_GPU_KERNELS", "softmax", "layer-norm"],
        ),
        &[("EMBER_GPU_KERNELS", "-attention,-softmax")],
    ),
    with_env(
        case(
            "device",
            "a split of a weight gradient that is not a power of two",
            &["train", "--config", "$TMP/ok.toml", "--out", "$TMP/new-run"],
            &["EMBER_SPLIT_K", "\"3\"", "power of two"],
        ),
        &[("EMBER_SPLIT_K", "3")],
    ),
    with_env(
        case(
            "device",
            "a value of `EMBER_CUDNN_ATTENTION` other than on or off",
            &["train", "--config", "$TMP/ok.toml", "--out", "$TMP/new-run"],
            &["EMBER_CUDNN_ATTENTION", "\"yes\"", "expected on"],
        ),
        &[("EMBER_CUDNN_ATTENTION", "yes")],
    ),
    // Launched across processes.
    with_env(
        case(
            "processes",
            "a rank outside the launcher's world",
            &["train", "--config", "$TMP/ok.toml", "--out", "$TMP/new-run"],
            &["RANK=2", "WORLD_SIZE=2"],
        ),
        &[("RANK", "2"), ("WORLD_SIZE", "2")],
    ),
    with_env(
        case(
            "processes",
            "a list of devices for one launched process",
            &[
                "train",
                "--config",
                "$TMP/ok.toml",
                "--out",
                "$TMP/new-run",
                "--devices",
                "flex,flex",
            ],
            &["flex,flex", "one device"],
        ),
        &[("RANK", "0"), ("WORLD_SIZE", "2")],
    ),
    with_env(
        case(
            "processes",
            "a rendezvous port that is not a number",
            &["train", "--config", "$TMP/ok.toml", "--out", "$TMP/new-run"],
            &["MASTER_PORT", "port number"],
        ),
        &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "http")],
    ),
    // Output and training.
    case(
        "output",
        "output folder cannot be created",
        &[
            "train",
            "--config",
            "$TMP/ok.toml",
            "--out",
            "$TMP/empty.txt/run",
        ],
        &["empty.txt/run"],
    ),
    case(
        "output",
        "`attention --out` in a folder that does not exist",
        &[
            "attention",
            "--checkpoint",
            "$TMP/run",
            "--text",
            "ROMEO",
            "--out",
            "$TMP/no-such-folder/map.png",
        ],
        &["no-such-folder/map.png", "No such file"],
    ),
    case(
        "training",
        "loss becomes NaN (resumed with `lr = 1e30`)",
        &[
            "train",
            "--config",
            "$TMP/diverge.toml",
            "--out",
            "$TMP/diverge",
            "--resume",
        ],
        &["step", "diverged", "last good checkpoint"],
    ),
    case(
        "training",
        "a model too large for the memory free (`d_model = 1000000`)",
        &[
            "train",
            "--config",
            "$TMP/ok.toml",
            "--out",
            "$TMP/new-run",
            "--set",
            "model.d_model=1000000",
        ],
        &["parameters", "AdamW", "training.batch_size", "is free"],
    ),
];

/// Successful runs that still have something to say: one `note:` line each.
const NOTES: &[Case] = &[
    case(
        "prompt",
        "characters outside the vocabulary",
        &[
            "generate",
            "--checkpoint",
            "$TMP/run",
            "--prompt",
            "Zebra ☃ ☃",
            "--max-tokens",
            "5",
        ],
        &["2 character(s)", "unknown"],
    ),
    case(
        "prompt",
        "prompt longer than the context",
        &[
            "generate",
            "--checkpoint",
            "$TMP/run",
            "--prompt",
            "$LONG",
            "--max-tokens",
            "5",
        ],
        &["47 tokens", "last 32"],
    ),
    case(
        "data",
        "`eval` text with unknown characters",
        &[
            "eval",
            "--checkpoint",
            "$TMP/run",
            "--data",
            "$TMP/unknown-chars.txt",
        ],
        &["unknown"],
    ),
    case(
        "run folder",
        "`--resume` with a changed `[model]` value",
        &[
            "train",
            "--config",
            "$TMP/ok.toml",
            "--out",
            "$TMP/resumed",
            "--resume",
            "--set",
            "model.dropout=0.3",
            "--set",
            "training.max_steps=21",
        ],
        &[
            "model.dropout = ",
            "(the config says 0.3)",
            "continues the saved model",
        ],
    ),
];

fn write(dir: &Path, name: &str, text: impl AsRef<[u8]>) {
    std::fs::write(dir.join(name), text).unwrap();
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        let target = to.join(path.file_name().unwrap());
        if path.is_dir() {
            copy_dir(&path, &target);
        } else {
            std::fs::copy(&path, &target).unwrap();
        }
    }
}

const MODEL: &str = "[model]\nd_model = 32\nn_heads = 2\nn_layers = 2\ncontext_len = 32\n";

/// Makes every file the cases name, including a small trained run and damaged copies of it.
fn fixtures(dir: &Path) {
    let corpus = repo().join("data/tinyshakespeare.txt");
    let corpus = corpus.to_str().unwrap();
    let data = |path: &str| format!("{MODEL}[data]\npath = {path:?}\n");
    write(dir, "not-toml.toml", "this is [not toml\n");
    write(dir, "unknown-key.toml", "[model]\nd_modle = 3\n");
    write(dir, "wrong-type.toml", "[model]\nd_model = \"big\"\n");
    write(dir, "task.toml", "task = \"vision\"\n");
    write(dir, "zero-layers.toml", "[model]\nn_layers = 0\n");
    write(dir, "zero-batch.toml", "[training]\nbatch_size = 0\n");
    write(dir, "negative.toml", "[model]\nd_model = -4\n");
    write(dir, "heads.toml", "[model]\nd_model = 30\nn_heads = 4\n");
    write(
        dir,
        "context.toml",
        "[model]\ncontext_len = 64\nmax_positions = 32\n",
    );
    write(
        dir,
        "position-init.toml",
        "[model]\npositional = \"rotary\"\nposition_init = \"sinusoidal\"\n",
    );
    write(dir, "nan-lr.toml", "[training]\nlr = nan\n");
    write(dir, "negative-lr.toml", "[training]\nlr = -1.0\n");
    write(
        dir,
        "mt-unknown.toml",
        "task = \"translation\"\n[data]\nvocab = 3\n",
    );
    write(dir, "device.toml", "[training]\ndevice = \"wgpu\"\n");

    write(dir, "empty.txt", "");
    write(dir, "binary.txt", b"abc\n\xff\xfe");
    write(dir, "short.txt", "hello");
    write(dir, "unknown-chars.txt", "Zebra ☃ ☃ quartz\n".repeat(20));
    write(dir, "three.de", "a\nb\nc\n");
    write(dir, "two.en", "a\nb\n");
    let d = dir.to_str().unwrap();
    write(dir, "data-missing.toml", data(&format!("{d}/nope.txt")));
    write(dir, "data-empty.toml", data(&format!("{d}/empty.txt")));
    write(dir, "data-binary.toml", data(&format!("{d}/binary.txt")));
    write(dir, "data-short.toml", data(&format!("{d}/short.txt")));
    write(
        dir,
        "mt-misaligned.toml",
        format!(
            "task = \"translation\"\n[data]\ntrain_src = \"{d}/three.de\"\ntrain_tgt = \"{d}/two.en\"\nval_src = \"{d}/three.de\"\nval_tgt = \"{d}/two.en\"\n"
        ),
    );

    // A small trained run, and damaged copies of its checkpoint.
    let training = "[training]\nbatch_size = 4\nmax_steps = 20\ncheckpoint_interval = 10\neval_interval = 20\neval_batches = 1\n";
    write(dir, "ok.toml", format!("{}{training}", data(corpus)));
    let run = dir.join("run");
    ember_ok(&[
        "train",
        "--config",
        &format!("{d}/ok.toml"),
        "--out",
        run.to_str().unwrap(),
    ]);
    let checkpoint = run.join("checkpoints/step-0000020");
    let damaged = |name: &str, file: &str, change: &dyn Fn(&Path)| {
        let copy = dir.join(name);
        copy_dir(&checkpoint, &copy);
        change(&copy.join(file));
    };
    damaged("truncated", "model.bpk", &|f| {
        let bytes = std::fs::read(f).unwrap();
        std::fs::write(f, &bytes[..bytes.len() / 2]).unwrap();
    });
    damaged("foreign", "model.bpk", &|f| {
        std::fs::write(f, "not weights at all".repeat(100)).unwrap();
    });
    damaged("foreign-state", "state.json", &|f| {
        std::fs::write(f, "{\"hello\": 1}").unwrap();
    });
    damaged("newer", "state.json", &|f| {
        let text = std::fs::read_to_string(f).unwrap();
        let text = text.replace("\"format_version\": 1", "\"format_version\": 99");
        std::fs::write(f, text).unwrap();
    });
    damaged("other-arch", "config.toml", &|f| {
        let text = std::fs::read_to_string(f).unwrap();
        std::fs::write(f, text.replace("d_model = 32", "d_model = 64")).unwrap();
    });
    damaged("moved-corpus", "config.toml", &|f| {
        let text = std::fs::read_to_string(f).unwrap();
        assert!(text.contains(corpus));
        std::fs::write(f, text.replace(corpus, &format!("{d}/gone.txt"))).unwrap();
    });
    std::fs::create_dir_all(dir.join("empty-dir")).unwrap();
    write(dir, "init-arch.toml", "[model]\nd_model = 64\n");

    // A text too large for a run to tokenize (sparse: no disk used), and a prepared corpus with
    // damaged copies.
    std::fs::File::create(dir.join("huge.txt"))
        .unwrap()
        .set_len(65 << 20)
        .unwrap();
    write(dir, "data-huge.toml", data(&format!("{d}/huge.txt")));
    write(dir, "data-folder.toml", data(&format!("{d}/empty-dir")));
    let prepared = dir.join("prep");
    ember_ok(&["prepare", corpus, "--out", prepared.to_str().unwrap()]);
    write(
        dir,
        "prep-init.toml",
        format!("[data]\npath = {:?}\n", format!("{d}/prep")),
    );
    write(
        dir,
        "prep-bpe.toml",
        format!("{}tokenizer = \"bpe\"\n", data(&format!("{d}/prep"))),
    );
    let broken = |name: &str, file: &str, change: &dyn Fn(&Path)| {
        copy_dir(&prepared, &dir.join(name));
        change(&dir.join(name).join(file));
        write(dir, &format!("{name}.toml"), data(&format!("{d}/{name}")));
    };
    broken("prep-truncated", "tokens.bin", &|f| {
        let bytes = std::fs::read(f).unwrap();
        std::fs::write(f, &bytes[..bytes.len() / 2]).unwrap();
    });
    broken("prep-foreign", "tokens.bin", &|f| {
        std::fs::write(f, "not tokens at all".repeat(100)).unwrap();
    });
    broken("prep-newer", "tokens.bin", &|f| {
        let mut bytes = std::fs::read(f).unwrap();
        bytes[8] = 99;
        std::fs::write(f, bytes).unwrap();
    });
    broken("prep-other-tokenizer", "chars.json", &|f| {
        std::fs::write(f, "{\"kind\": \"char\", \"chars\": \"abc\"}").unwrap();
    });

    // Hugging Face folders whose config.json does not fit their weights.
    let gpt2 = repo().join("crates/ember-train/tests/fixtures/tiny-gpt2");
    for (name, from, to) in [
        ("hf-deeper", "\"n_layer\": 2", "\"n_layer\": 3"),
        ("hf-wider", "\"n_embd\": 32", "\"n_embd\": 64"),
    ] {
        copy_dir(&gpt2, &dir.join(name));
        let config = dir.join(name).join("config.json");
        let text = std::fs::read_to_string(&config).unwrap();
        assert!(text.contains(from));
        std::fs::write(&config, text.replace(from, to)).unwrap();
    }

    // A Llama whose config asks for YaRN's stretched rotation.
    let llama = repo().join("crates/ember-train/tests/fixtures/tiny-llama");
    copy_dir(&llama, &dir.join("hf-yarn"));
    let config = dir.join("hf-yarn").join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    let from = "\"rope_type\": \"default\"";
    assert!(text.contains(from));
    std::fs::write(&config, text.replace(from, "\"rope_type\": \"yarn\"")).unwrap();

    // A Hugging Face model saved in PyTorch's pickle format.
    let bin = dir.join("hf-bin");
    std::fs::create_dir_all(&bin).unwrap();
    for file in ["config.json", "tokenizer.json"] {
        std::fs::copy(gpt2.join(file), bin.join(file)).unwrap();
    }
    write(&bin, "pytorch_model.bin", "not read");

    // A Llama in shards, its index naming a shard the folder lacks.
    let shards = dir.join("hf-shards");
    std::fs::create_dir_all(&shards).unwrap();
    for file in ["config.json", "tokenizer.json"] {
        std::fs::copy(llama.join(file), shards.join(file)).unwrap();
    }
    write(
        &shards,
        "model.safetensors.index.json",
        r#"{"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}"#,
    );

    // A run folder that a Hugging Face model was copied into.
    copy_dir(&run, &dir.join("hf-and-run"));
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(gpt2.join(file), dir.join("hf-and-run").join(file)).unwrap();
    }

    // A copy of the run to resume.
    copy_dir(&run, &dir.join("resumed"));

    // Resuming the run with an absurd learning rate makes the loss NaN.
    copy_dir(&run, &dir.join("diverge"));
    let diverge = format!("{}{}", data(corpus), training).replace(
        "max_steps = 20",
        "max_steps = 40\nlr = 1e30\nwarmup_steps = 0",
    );
    write(dir, "diverge.toml", diverge);
}

fn run_case(dir: &Path, case: &Case) -> Output {
    let d = dir.to_str().unwrap();
    let long = "ROMEO: ".repeat(6) + "ROMEO";
    let args: Vec<String> = case
        .args
        .iter()
        .map(|a| a.replace(TMP, d).replace("$LONG", &long))
        .collect();
    let mut command = Command::new(env!("CARGO_BIN_EXE_ember"));
    for (name, value) in case.env {
        command.env(name, value);
    }
    let mut child = command
        .args(&args)
        .current_dir(repo())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ember runs");
    let mut stdin = child.stdin.take().unwrap();
    if let Some(text) = case.stdin {
        use std::io::Write;
        stdin.write_all(text.as_bytes()).unwrap();
    }
    drop(stdin);
    child.wait_with_output().unwrap()
}

/// The single line of `stderr` starting with `prefix`, with the fixture folder as `$TMP`; or
/// what is wrong with the output.
fn the_line(case: &Case, out: &Output, prefix: &str, dir: &Path) -> Result<String, String> {
    let stderr = String::from_utf8_lossy(&out.stderr);
    if stderr.contains("panicked") || stderr.contains("RUST_BACKTRACE") {
        return Err(format!("{}: a panic: {stderr}", case.input));
    }
    let lines: Vec<&str> = stderr.lines().filter(|l| l.starts_with(prefix)).collect();
    if lines.len() != 1 {
        return Err(format!("{}: want one {prefix} line: {stderr}", case.input));
    }
    let line = free_memory_masked(&lines[0].replace(dir.to_str().unwrap(), TMP));
    match case.needles.iter().find(|n| !line.contains(*n)) {
        Some(needle) => Err(format!("{}: {needle:?} missing from {line}", case.input)),
        None => Ok(line),
    }
}

/// `line` with the machine's free memory ("23.2 GB is free") as `$FREE`, the one figure of a
/// message that changes from machine to machine.
fn free_memory_masked(line: &str) -> String {
    let Some(end) = line.find(" is free") else {
        return line.to_string();
    };
    // The figure and its unit: the two words before " is free".
    let start = line[..end]
        .rmatch_indices(' ')
        .nth(1)
        .map_or(0, |(i, _)| i + 1);
    format!("{}$FREE{}", &line[..start], &line[end..])
}

fn table(rows: &[(&Case, String)]) -> String {
    let mut text = String::from("| Area | Input | Command | Message |\n|---|---|---|---|\n");
    for (case, line) in rows {
        let command = case
            .args
            .iter()
            .map(|a| {
                if *a == "$LONG" {
                    "\"ROMEO: ROMEO: …\" (47 characters)".to_string()
                } else if a.is_empty() || a.contains(' ') {
                    format!("{a:?}")
                } else {
                    a.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join(" ");
        let cell = |s: &str| s.replace('|', "\\|");
        text += &format!(
            "| {} | {} | `{}ember {}` | `` {} `` |\n",
            case.area,
            cell(case.input),
            case.env
                .iter()
                .map(|(name, value)| format!("{name}={value:?} "))
                .collect::<String>(),
            cell(&command),
            cell(line)
        );
    }
    text
}

/// Replaces the text between `<!-- NAME:start -->` and `<!-- NAME:end -->`.
fn splice(doc: &str, name: &str, body: &str) -> String {
    let (start, end) = (
        format!("<!-- {name}:start -->\n"),
        format!("<!-- {name}:end -->"),
    );
    let a = doc.find(&start).expect("start marker") + start.len();
    let b = doc.find(&end).expect("end marker");
    format!("{}{body}{}", &doc[..a], &doc[b..])
}

#[test]
fn every_bad_input_gets_one_clear_line_and_the_docs_table_lists_it() {
    let dir = temp("errors");
    fixtures(&dir);
    let mut failures = Vec::new();
    let mut check = |cases: &'static [Case], prefix: &str, succeed: bool| {
        let mut rows = Vec::new();
        for case in cases {
            let out = run_case(&dir, case);
            if out.status.success() != succeed {
                failures.push(format!(
                    "{}: exit {:?}: {}",
                    case.input,
                    out.status.code(),
                    String::from_utf8_lossy(&out.stderr)
                ));
                continue;
            }
            match the_line(case, &out, prefix, &dir) {
                Ok(line) => rows.push((case, line)),
                Err(failure) => failures.push(failure),
            }
        }
        rows
    };
    let errors = check(CASES, "error:", false);
    let notes = check(NOTES, "note:", true);
    assert!(failures.is_empty(), "{}", failures.join("\n"));

    // The divergence kept the last good checkpoint: the run still resolves to step 20.
    let kept = ember_train::checkpoint::resolve(&dir.join("diverge")).unwrap();
    assert!(kept.ends_with("step-0000020"), "{}", kept.display());
    ember_train::load_lm(&kept, &burn::tensor::Device::flex()).unwrap();

    let doc_path: PathBuf = repo().join("docs/errors.md");
    let doc = std::fs::read_to_string(&doc_path).unwrap();
    let fresh = splice(
        &splice(&doc, "errors", &table(&errors)),
        "notes",
        &table(&notes),
    );
    if std::env::var_os("EMBER_BLESS").is_some() {
        std::fs::write(&doc_path, &fresh).unwrap();
    } else {
        assert!(
            doc == fresh,
            "docs/errors.md is out of date; rerun with EMBER_BLESS=1 and review the diff"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}
