//! The `ember` binary as a user meets it: help, the train -> generate -> eval chain, and clear
//! one-line errors for bad input.

mod common;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use common::{assert_clear_error, ember, ember_ok, params, repo, temp};

/// A tiny model trained once for all tests that need a checkpoint.
fn trained() -> &'static PathBuf {
    static RUN: OnceLock<PathBuf> = OnceLock::new();
    RUN.get_or_init(|| {
        let dir = temp("trained").join("run");
        let config = repo().join("configs/tiny.toml");
        ember_ok(&[
            "train",
            "--config",
            config.to_str().unwrap(),
            "--out",
            dir.to_str().unwrap(),
        ]);
        dir
    })
}

#[test]
fn every_subcommand_has_help() {
    let top = ember(&["--help"]);
    assert!(top.status.success());
    for sub in [
        "train",
        "generate",
        "eval",
        "translate",
        "bleu",
        "attention",
        "export",
        "average",
    ] {
        assert!(
            String::from_utf8_lossy(&top.stdout).contains(sub),
            "{sub} missing from --help"
        );
        let out = ember_ok(&[sub, "--help"]);
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("Usage"),
            "{sub}"
        );
    }
}

#[test]
fn train_then_generate_then_eval() {
    let run = trained().to_str().unwrap();
    let gen_args = [
        "generate",
        "--checkpoint",
        run,
        "--prompt",
        "ROMEO:",
        "--max-tokens",
        "60",
        "--seed",
        "3",
    ];
    let a = ember(&gen_args);
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    let text = String::from_utf8_lossy(&a.stdout).to_string();
    assert!(
        text.starts_with("ROMEO:") && text.chars().count() >= 60,
        "{text:?}"
    );
    let summary = String::from_utf8_lossy(&a.stderr);
    assert!(summary.contains("tokens/s"), "{summary}");
    // On the CPU the tokens are chosen on the host, from logits it reads anyway.
    assert!(
        summary.contains("KV cache; tokens chosen on the host"),
        "{summary}"
    );
    // Same seed, same text; the KV cache does not change greedy output.
    assert_eq!(ember(&gen_args).stdout, a.stdout);
    let greedy = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--checkpoint",
            run,
            "--prompt",
            "First",
            "--max-tokens",
            "20",
            "--greedy",
        ];
        args.extend_from_slice(extra);
        ember(&args).stdout
    };
    assert_eq!(greedy(&[]), greedy(&["--no-cache"]));

    let eval = ember(&[
        "eval",
        "--checkpoint",
        run,
        "--data",
        "data/tinyshakespeare.txt",
        "--json",
    ]);
    assert!(eval.status.success());
    let json: serde_json::Value = serde_json::from_slice(&eval.stdout).unwrap();
    let loss = json["loss"].as_f64().unwrap();
    assert!(loss > 1.0 && loss < 3.0, "{json}");
    assert!((json["perplexity"].as_f64().unwrap() - loss.exp()).abs() < 1e-6);
    assert_eq!(json["unknown"], 0);
    assert!(json["tokens"].as_u64().unwrap() > 1_000_000);

    // --split scores the run's own held-out tenth: the same figure as its text given as a file.
    let split = ember_ok(&["eval", "--checkpoint", run, "--split", "val", "--json"]);
    let split: serde_json::Value = serde_json::from_slice(&split.stdout).unwrap();
    let text = std::fs::read_to_string(repo().join("data/tinyshakespeare.txt")).unwrap();
    let chars: Vec<char> = text.chars().collect();
    let tail: String = chars[(chars.len() as f64 * 0.9) as usize..]
        .iter()
        .collect();
    let file = temp("eval-split").join("val.txt");
    std::fs::write(&file, &tail).unwrap();
    let whole = ember_ok(&[
        "eval",
        "--checkpoint",
        run,
        "--data",
        file.to_str().unwrap(),
        "--json",
    ]);
    let whole: serde_json::Value = serde_json::from_slice(&whole.stdout).unwrap();
    assert_eq!(split, whole);
    assert_eq!(
        split["tokens"].as_u64().unwrap() as usize,
        tail.chars().count() - 1
    );
    assert!(ember(&["eval", "--checkpoint", run]).status.code() == Some(2));
}

#[test]
fn stop_string_ends_the_sample_and_long_prompts_are_cut() {
    let run = trained().to_str().unwrap();
    let out = ember(&[
        "generate",
        "--checkpoint",
        run,
        "--prompt",
        "KING:",
        "--max-tokens",
        "300",
        "--stop",
        "\n",
    ]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.trim_end_matches('\n').contains('\n'), "{text:?}");

    let long = "To be, or not to be, that is the question. ".repeat(10);
    let out = ember(&[
        "generate",
        "--checkpoint",
        run,
        "--prompt",
        &long,
        "--max-tokens",
        "10",
    ]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("sees only the last 32"));

    let out = ember(&[
        "generate",
        "--checkpoint",
        run,
        "--prompt",
        "Ωμέγα",
        "--max-tokens",
        "5",
    ]);
    assert!(out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("5 character(s) of the prompt are not in the model's vocabulary")
    );
}

#[test]
fn interrupted_and_resumed_training_with_dropout_matches_an_uninterrupted_run() {
    let dir = temp("resume");
    let corpus = repo().join("data/tinyshakespeare.txt");
    let config = dir.join("dropout.toml");
    std::fs::write(
        &config,
        format!(
            "[model]\nd_model = 32\nn_heads = 2\nn_layers = 2\ncontext_len = 32\ndropout = 0.1\n\
             [data]\npath = {:?}\n\
             [training]\nmax_steps = 30\ncheckpoint_interval = 10\neval_interval = 30\neval_batches = 2\ngrad_accum = 2\nbatch_size = 4\n",
            corpus.to_str().unwrap()
        ),
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let train = |out: &Path, extra: &[&str]| {
        let mut args = vec!["train", "--config", config, "--out", out.to_str().unwrap()];
        args.extend_from_slice(extra);
        let result = ember(&args);
        assert!(
            result.status.success(),
            "{}",
            String::from_utf8_lossy(&result.stderr)
        );
    };
    let (whole, split) = (dir.join("whole"), dir.join("split"));
    train(&whole, &[]);
    train(&split, &["--stop-after", "10"]);
    train(&split, &["--resume", "--stop-after", "20"]);
    train(&split, &["--resume"]);
    let (a, b) = (params(&whole), params(&split));
    assert_eq!(a.len(), b.len());
    assert!(
        a.iter().zip(&b).all(|(x, y)| x == y),
        "resumed parameters differ"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn translation_commands_train_translate_and_score() {
    let dir = temp("mt");
    let run = dir.join("run");
    let config = repo().join("configs/multi30k-tiny.toml");
    let out = ember_ok(&[
        "train",
        "--config",
        config.to_str().unwrap(),
        "--out",
        run.to_str().unwrap(),
    ]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("val BLEU"));
    // An epoch's batches and target tokens, in the line scripts/bench-gpu.sh's `mt` stage reads
    // (its PyTorch reference must cut the same batches): every batch holds at least one target
    // token and at most its padded budget.
    let line = said.lines().find(|l| l.starts_with("batches: ")).unwrap();
    let numbers: Vec<usize> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse().ok())
        .collect();
    let [batches, budget, tokens] = numbers[..] else {
        panic!("{line}")
    };
    assert!(
        line == format!(
            "batches: {batches} a training epoch, of at most {budget} padded tokens ({tokens} target tokens)"
        ) && batches > 0
            && (batches..=batches * budget).contains(&tokens),
        "{line}"
    );
    let input = dir.join("in.de");
    std::fs::write(&input, "Ein Hund läuft.\nZwei Männer spielen Fußball.\n").unwrap();
    // Blank lines stay blank, the others translate as without them: the output stays aligned.
    let gaps = dir.join("gaps.de");
    std::fs::write(
        &gaps,
        "\nEin Hund läuft.\n  \nZwei Männer spielen Fußball.\n",
    )
    .unwrap();
    for beam in ["1", "3"] {
        let translate = |file: &Path| {
            let out = ember_ok(&[
                "translate",
                "--checkpoint",
                run.to_str().unwrap(),
                "--input",
                file.to_str().unwrap(),
                "--beam",
                beam,
            ]);
            String::from_utf8_lossy(&out.stdout).to_string()
        };
        let plain = translate(&input);
        assert_eq!(plain.lines().count(), 2);
        let lines: Vec<&str> = plain.lines().collect();
        assert_eq!(
            translate(&gaps),
            format!("\n{}\n\n{}\n", lines[0], lines[1])
        );
    }
    // The mean of the run's two checkpoints (steps 20 and 40) translates like any checkpoint.
    let averaged = dir.join("avg");
    let out = ember_ok(&[
        "average",
        run.to_str().unwrap(),
        "--out",
        averaged.to_str().unwrap(),
    ]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("averaged 2 checkpoints (steps 20, 40)"),
        "{said}"
    );
    let out = ember_ok(&[
        "translate",
        "--checkpoint",
        averaged.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
    ]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 2);
    // Cross-attention of the translation, averaged over heads: one panel per decoder layer.
    let (png, json) = (dir.join("cross.png"), dir.join("cross.json"));
    ember_ok(&[
        "attention",
        "--checkpoint",
        run.to_str().unwrap(),
        "--text",
        "Ein Hund läuft.",
        "--out",
        png.to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
    ]);
    let maps: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(maps["maps"].as_array().unwrap().len(), 2);
    for row in maps["maps"][0]["weights"].as_array().unwrap() {
        let sum: f64 = row
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .sum();
        assert!((sum - 1.0).abs() < 1e-5);
    }
    assert_eq!(maps["columns"].as_array().unwrap().last().unwrap(), "<eos>");
    // A language-model command on a translation checkpoint says what is wrong.
    assert_clear_error(
        &ember(&[
            "generate",
            "--checkpoint",
            run.to_str().unwrap(),
            "--prompt",
            "x",
        ]),
        &["translation", "language model"],
    );

    let hyp = dir.join("hyp.txt");
    let reference = dir.join("ref.txt");
    std::fs::write(&hyp, "the cat sat on the mat\n").unwrap();
    std::fs::write(&reference, "the cat is on the mat today\n").unwrap();
    let out = ember_ok(&[
        "bleu",
        "--hyp",
        hyp.to_str().unwrap(),
        "--ref",
        reference.to_str().unwrap(),
        "--json",
    ]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let p = [500.0f64 / 6.0, 60.0, 25.0, 100.0 / 6.0];
    let want = (1.0f64 - 7.0 / 6.0).exp() * (p.iter().map(|x| x.ln()).sum::<f64>() / 4.0).exp();
    assert!(
        (json["score"].as_f64().unwrap() - want).abs() < 1e-9,
        "{json}"
    );
    assert_eq!(json["name"], "BLEU");
    let signature = json["signature"].as_str().unwrap();
    assert!(
        signature.starts_with("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:"),
        "{signature}"
    );
    assert_eq!(json["tok"], "13a");
    let out = ember_ok(&[
        "bleu",
        "--hyp",
        hyp.to_str().unwrap(),
        "--ref",
        reference.to_str().unwrap(),
        "--lowercase",
    ]);
    let line = String::from_utf8_lossy(&out.stdout);
    assert!(
        line.starts_with("BLEU|nrefs:1|case:lc|eff:no|tok:13a|smooth:exp|version:")
            && line.contains(&format!(" = {want:.2} ")),
        "{line}"
    );
    assert_eq!(json["hyp_len"], 6);
    assert_eq!(json["ref_len"], 7);

    std::fs::write(&reference, "one\ntwo\n").unwrap();
    let out = ember(&[
        "bleu",
        "--hyp",
        hyp.to_str().unwrap(),
        "--ref",
        reference.to_str().unwrap(),
    ]);
    assert_clear_error(&out, &["hyp.txt has 1 lines", "ref.txt has 2"]);

    let misaligned = dir.join("misaligned.toml");
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("data/multi30k/train.en", "data/multi30k/val.en");
    std::fs::write(&misaligned, text).unwrap();
    assert_clear_error(
        &ember(&[
            "train",
            "--config",
            misaligned.to_str().unwrap(),
            "--out",
            dir.join("x").to_str().unwrap(),
        ]),
        &["train.de has 29000 lines", "val.en has 1014"],
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// `ember attention` on Hugging Face folders (GPT-2 and GPT-NeoX): every layer's and head's
/// weights, the model's own.
#[test]
fn attention_pictures_of_hugging_face_folders() {
    let dir = temp("attention-hf");
    let text = "ROMEO: O, she doth teach";
    for name in ["tiny-gpt2", "tiny-neox"] {
        let folder = repo().join("crates/ember-train/tests/fixtures").join(name);
        let json = dir.join(format!("{name}.json"));
        ember_ok(&[
            "attention",
            "--checkpoint",
            folder.to_str().unwrap(),
            "--text",
            text,
            "--out",
            dir.join(format!("{name}.png")).to_str().unwrap(),
            "--json",
            json.to_str().unwrap(),
        ]);
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        let maps = json["maps"].as_array().unwrap();
        assert_eq!(maps.len(), 8, "{name}: 2 layers of 4 heads");
        let lm = ember_train::load_lm(&folder, &burn::tensor::Device::flex()).unwrap();
        let ids = lm.tokenizer.encode(text).unwrap().ids;
        let want = ember_infer::self_attention(&lm.model, &ids);
        let last = &maps[7];
        let (layer, head) = (
            last["layer"].as_u64().unwrap() as usize,
            last["head"].as_u64(),
        );
        let reference = want
            .iter()
            .find(|m| m.layer == layer && m.head.map(|h| h as u64) == head)
            .unwrap();
        let row = ids.len() - 1;
        for (j, w) in last["weights"][row].as_array().unwrap().iter().enumerate() {
            let w = w.as_f64().unwrap();
            assert!(
                (w - reference.weights[row][j] as f64).abs() < 1e-6,
                "{name}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn attention_pictures_hold_the_weights_the_model_used() {
    let run = trained();
    let dir = temp("attention");
    let (png, json) = (dir.join("a.png"), dir.join("a.json"));
    let text = "ROMEO: O, she doth teach";
    ember_ok(&[
        "attention",
        "--checkpoint",
        run.to_str().unwrap(),
        "--text",
        text,
        "--layer",
        "1",
        "--out",
        png.to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(&std::fs::read(&png).unwrap()[..8], b"\x89PNG\r\n\x1a\n");

    // The drawn weights are the model's own for that input, row-stochastic and causal.
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let maps = json["maps"].as_array().unwrap();
    assert_eq!(maps.len(), 2, "layer 1 of the tiny model has 2 heads");
    let device = burn::tensor::Device::flex();
    let lm = ember_train::load_lm(run, &device).unwrap();
    let ids = lm.tokenizer.encode(text).unwrap().ids;
    let want = ember_infer::self_attention(&lm.model, &ids);
    for map in maps {
        let head = map["head"].as_u64().unwrap() as usize;
        let reference = want
            .iter()
            .find(|m| m.layer == 1 && m.head == Some(head))
            .unwrap();
        let rows = map["weights"].as_array().unwrap();
        assert_eq!(rows.len(), ids.len());
        for (i, row) in rows.iter().enumerate() {
            let row: Vec<f64> = row
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect();
            assert!(
                (row.iter().sum::<f64>() - 1.0).abs() < 1e-5,
                "row {i} sums to {}",
                row.iter().sum::<f64>()
            );
            for (j, &w) in row.iter().enumerate() {
                assert!((w - reference.weights[i][j] as f64).abs() < 1e-6);
                if j > i {
                    assert_eq!(w, 0.0, "causal model attends to the future at ({i}, {j})");
                }
            }
        }
    }
    // Independently of the helper: the model's forward pass with weights returned.
    let tokens = burn::tensor::Tensor::<1, burn::tensor::Int>::from_ints(
        ids.iter().map(|&i| i as i32).collect::<Vec<_>>().as_slice(),
        &device,
    )
    .reshape([1, ids.len()]);
    let forward = lm.model.forward_with(tokens, None, None, true).weights[1]
        .self_attn
        .clone()
        .unwrap();
    let first = forward
        .slice([0..1, 0..1, 3..4, 0..ids.len()])
        .try_into_vec_as::<f32>()
        .unwrap();
    let drawn: Vec<f64> = maps[0]["weights"][3]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    for (a, b) in first.iter().zip(&drawn) {
        assert!((*a as f64 - b).abs() < 1e-6);
    }

    let svg = dir.join("all.svg");
    let out = ember(&[
        "attention",
        "--checkpoint",
        run.to_str().unwrap(),
        "--text",
        "To be",
        "--out",
        svg.to_str().unwrap(),
    ]);
    assert!(out.status.success());
    let text_svg = std::fs::read_to_string(&svg).unwrap();
    assert!(text_svg.starts_with("<svg") && text_svg.trim_end().ends_with("</svg>"));

    let long = "x".repeat(40);
    assert_clear_error(
        &ember(&[
            "attention",
            "--checkpoint",
            run.to_str().unwrap(),
            "--text",
            &long,
        ]),
        &["40 tokens", "context of 32"],
    );
    assert_clear_error(
        &ember(&[
            "attention",
            "--checkpoint",
            run.to_str().unwrap(),
            "--text",
            "To be",
            "--layer",
            "7",
        ]),
        &["--layer 7", "2 layers"],
    );
    assert_clear_error(
        &ember(&[
            "attention",
            "--checkpoint",
            run.to_str().unwrap(),
            "--text",
            "To be",
            "--head",
            "5",
        ]),
        &["--head 5", "2 heads"],
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// Stdout of a greedy sample.
fn greedy_text(checkpoint: &Path) -> String {
    let out = ember_ok(&[
        "generate",
        "--checkpoint",
        checkpoint.to_str().unwrap(),
        "--prompt",
        "ROMEO:",
        "--greedy",
        "--max-tokens",
        "20",
    ]);
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn exported_models_load_back_and_fine_tune_with_init_from() {
    let dir = temp("export");
    let run = trained();
    let hf = dir.join("hf");
    ember_ok(&[
        "export",
        "--checkpoint",
        run.to_str().unwrap(),
        "--out",
        hf.to_str().unwrap(),
        "--format",
        "hf",
    ]);
    for file in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(hf.join(file).is_file(), "{file} missing");
    }
    // The Hugging Face folder is the same model: same greedy text, same loss.
    assert_eq!(greedy_text(&hf), greedy_text(run));
    let text = dir.join("text.txt");
    std::fs::write(&text, "ROMEO:\nWhat light through yonder window breaks?\n").unwrap();
    let loss = |checkpoint: &Path| -> f64 {
        let out = ember_ok(&[
            "eval",
            "--checkpoint",
            checkpoint.to_str().unwrap(),
            "--data",
            text.to_str().unwrap(),
            "--json",
        ]);
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        json["loss"].as_f64().unwrap()
    };
    assert!((loss(&hf) - loss(run)).abs() < 1e-6);

    // Fine-tuning from the export: its architecture, this config's context and dropout.
    let config = dir.join("finetune.toml");
    std::fs::write(
        &config,
        format!(
            "[model]\ncontext_len = 16\ndropout = 0.1\n[data]\npath = {:?}\n\
             [training]\nmax_steps = 10\nlr = 1e-4\nwarmup_steps = 0\neval_interval = 10\neval_batches = 4\n",
            repo().join("data/tinyshakespeare.txt").to_str().unwrap()
        ),
    )
    .unwrap();
    let tuned = dir.join("tuned");
    ember_ok(&[
        "train",
        "--config",
        config.to_str().unwrap(),
        "--init-from",
        hf.to_str().unwrap(),
        "--out",
        tuned.to_str().unwrap(),
    ]);
    let saved = std::fs::read_to_string(tuned.join("config.toml")).unwrap();
    let saved: toml::Table = saved.parse().unwrap();
    let model = saved["model"].as_table().unwrap();
    assert_eq!(
        model["d_model"].as_integer(),
        Some(32),
        "architecture of the source"
    );
    assert_eq!(
        model["context_len"].as_integer(),
        Some(16),
        "context of the config"
    );
    assert_eq!(model["max_positions"].as_integer(), Some(32));
    // Started from trained weights: far below the ln(66) = 4.19 of a fresh model.
    let metrics = std::fs::read_to_string(tuned.join("metrics.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(metrics.lines().next().unwrap()).unwrap();
    let first_loss = first["train_loss"].as_f64().unwrap();
    assert!(first_loss < 3.0, "first logged loss {first_loss}");
    let _ = std::fs::remove_dir_all(dir);
}
