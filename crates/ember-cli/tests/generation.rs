//! `ember generate`'s controls through the binary, on the tiny Hugging Face GPT-2 fixture (a
//! byte-level BPE with `<|endoftext|>`): end-of-text, several stop strings, no echo, the
//! repetition penalty, prompts from stdin, a file and a file of lines; and the exit codes.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};

use common::{assert_clear_error, ember, ember_ok, repo, temp};

const EOT: &str = "<|endoftext|>";

fn fixture() -> String {
    repo()
        .join("crates/ember-train/tests/fixtures/tiny-gpt2")
        .to_str()
        .unwrap()
        .to_string()
}

/// stdout of a successful `ember generate` on the fixture with `args`.
fn generate(args: &[&str]) -> String {
    let fixture = fixture();
    let mut all = vec!["generate", "--checkpoint", &fixture];
    all.extend_from_slice(args);
    String::from_utf8(ember_ok(&all).stdout).unwrap()
}

/// A hot sample (temperature 50: nearly uniform over 300 tokens) that meets `<|endoftext|>`.
const HOT: [&str; 10] = [
    "--prompt",
    "Hello",
    "--temperature",
    "50",
    "--max-tokens",
    "1500",
    "--seed",
    "1",
    "--no-echo",
    "--no-cache",
];

#[test]
fn generation_stops_at_end_of_text_unless_told_to_go_on() {
    let on = generate(&[&HOT[..], &["--ignore-eot"]].concat());
    let at = on.find(EOT).expect("the hot sample meets <|endoftext|>");
    assert!(
        on.len() > at + EOT.len() + 100,
        "--ignore-eot went on past it"
    );
    let stopped = generate(&HOT);
    assert_eq!(stopped.trim_end_matches('\n'), &on[..at]);
    assert!(!stopped.contains(EOT));
}

#[test]
fn several_stop_strings_cut_at_the_first_that_appears() {
    let on = generate(&[&HOT[..], &["--ignore-eot"]].concat());
    let chars: Vec<char> = on.chars().collect();
    let piece = |from: usize| chars[from..from + 3].iter().collect::<String>();
    let (late, early) = (piece(60), piece(30));
    let want = on.find(&early).unwrap().min(on.find(&late).unwrap());
    let cut = generate(
        &[
            &HOT[..],
            &["--ignore-eot", "--stop", &late, "--stop", &early],
        ]
        .concat(),
    );
    assert_eq!(cut.trim_end_matches('\n'), &on[..want]);
}

#[test]
fn echo_penalty_and_prompt_sources() {
    let greedy = ["--greedy", "--max-tokens", "40"];
    let echoed = generate(&[&greedy[..], &["--prompt", "The cat"]].concat());
    let bare = generate(&[&greedy[..], &["--prompt", "The cat", "--no-echo"]].concat());
    assert_eq!(echoed, format!("The cat{bare}"));

    // The penalty off is the same as no flag; a strong one breaks greedy loops, so more
    // distinct text appears.
    let one = generate(
        &[
            &greedy[..],
            &[
                "--prompt",
                "The cat",
                "--no-echo",
                "--repetition-penalty",
                "1",
            ],
        ]
        .concat(),
    );
    assert_eq!(one, bare);
    let penalised = generate(
        &[
            &greedy[..],
            &[
                "--prompt",
                "The cat",
                "--no-echo",
                "--repetition-penalty",
                "1000",
            ],
        ]
        .concat(),
    );
    let distinct = |s: &str| {
        let mut c: Vec<char> = s.chars().collect();
        c.sort();
        c.dedup();
        c.len()
    };
    assert!(
        distinct(&penalised) > distinct(&bare),
        "{penalised:?} vs {bare:?}"
    );

    // A prompt from a file (nanoGPT's FILE:) and from stdin is the same as on the command line.
    let dir = temp("prompts");
    let file = dir.join("prompt.txt");
    std::fs::write(&file, "The cat").unwrap();
    let from_file = generate(
        &[
            &greedy[..],
            &["--prompt", &format!("FILE:{}", file.display())],
        ]
        .concat(),
    );
    assert_eq!(from_file, echoed);
    let fixture = fixture();
    let mut child = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(["generate", "--checkpoint", &fixture, "--prompt", "-"])
        .args(greedy)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"The cat").unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(String::from_utf8(out.stdout).unwrap(), echoed);

    // A file of prompts: each continued in turn, whole, separated.
    let lines = dir.join("lines.txt");
    std::fs::write(&lines, "The cat\n\nA dog\n").unwrap();
    let both = generate(&[&greedy[..], &["--prompt-file", lines.to_str().unwrap()]].concat());
    let dog = generate(&[&greedy[..], &["--prompt", "A dog"]].concat());
    assert_eq!(both, format!("{echoed}\n---------------\n{dog}"));

    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "\n\n").unwrap();
    assert_clear_error(
        &ember(&[
            "generate",
            "--checkpoint",
            &fixture,
            "--prompt-file",
            empty.to_str().unwrap(),
        ]),
        &["empty.txt", "no non-empty line"],
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn exit_codes_are_zero_one_and_two() {
    let fixture = fixture();
    let ok = ember(&[
        "generate",
        "--checkpoint",
        &fixture,
        "--prompt",
        "a",
        "--max-tokens",
        "1",
    ]);
    assert_eq!(ok.status.code(), Some(0));
    // A bad value: an error of ember's, 1.
    let bad = ember(&[
        "generate",
        "--checkpoint",
        &fixture,
        "--prompt",
        "a",
        "--repetition-penalty",
        "0",
    ]);
    assert_clear_error(&bad, &["--repetition-penalty", "positive"]);
    assert_eq!(bad.status.code(), Some(1));
    // A command line that does not parse: a usage error, 2.
    for args in [
        vec!["generate", "--no-such-flag"],
        vec!["generate", "--checkpoint", &fixture],
        vec!["frobnicate"],
    ] {
        assert_eq!(ember(&args).status.code(), Some(2), "{args:?}");
    }
}

/// `--prompt-file` with several samples each runs as batches: the text equals generating every
/// sample one at a time (`--batch-size 1`), sampled or greedy, with a stop string ending some
/// samples early and a batch size that splits the rows unevenly.
#[test]
fn batched_prompts_print_what_one_at_a_time_prints() {
    let dir = temp("batch");
    let lines = dir.join("lines.txt");
    std::fs::write(&lines, "The cat\nA\nOnce upon a time there\n").unwrap();
    let file = lines.to_str().unwrap();
    for extra in [
        &["--greedy"][..],
        &["--temperature", "1.5", "--num-samples", "2"][..],
        &["--temperature", "1.5", "--stop", "e", "--no-echo"][..],
    ] {
        let args = [&["--prompt-file", file, "--max-tokens", "30"][..], extra].concat();
        let alone = generate(&[&args[..], &["--batch-size", "1"]].concat());
        for batch in ["2", "8"] {
            let together = generate(&[&args[..], &["--batch-size", batch]].concat());
            assert_eq!(together, alone, "{extra:?}, --batch-size {batch}");
        }
        assert!(alone.matches("---------------").count() >= 2, "{alone}");
    }
    let out = ember(&[
        "generate",
        "--checkpoint",
        &fixture(),
        "--prompt-file",
        file,
        "--batch-size",
        "0",
    ]);
    assert_clear_error(&out, &["--batch-size", "at least 1"]);
    let _ = std::fs::remove_dir_all(dir);
}

/// `--chat` lays the prompt out with the folder's chat template (a system message first with
/// `--system`) and prints the reply alone: the same text as the laid-out prompt continued
/// without echo. The reply ends at the ids `generation_config.json` lists; a folder without
/// a template is refused, naming it.
#[test]
fn chat_prompts_are_laid_out_by_the_template() {
    let dir = temp("chat");
    for entry in std::fs::read_dir(fixture()).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n\
                    {% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}";
    let config = serde_json::json!({
        "bos_token": EOT,
        "eos_token": {"content": EOT, "special": true},
        "chat_template": template,
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let laid_out = dir.join("prompt.txt");
    std::fs::write(
        &laid_out,
        format!("{EOT}[system] Be brief\n[user] Hi\n[assistant]"),
    )
    .unwrap();
    let checkpoint = dir.to_str().unwrap();
    let run = |args: &[&str]| {
        let mut all = vec!["generate", "--checkpoint", checkpoint, "--greedy"];
        all.extend_from_slice(args);
        String::from_utf8(ember_ok(&all).stdout).unwrap()
    };
    let chat_args = [
        "--chat",
        "--system",
        "Be brief",
        "--prompt",
        "Hi",
        "--max-tokens",
        "30",
    ];
    let chat = run(&chat_args);
    let file = format!("FILE:{}", laid_out.display());
    let plain = run(&["--prompt", &file, "--no-echo", "--max-tokens", "30"]);
    assert_eq!(chat, plain);
    assert!(
        !chat.contains("[user]"),
        "the prompt is not echoed: {chat:?}"
    );
    // Every id listed as an end in generation_config.json: the reply ends before its first
    // token.
    let every: Vec<u32> = (0..300).collect();
    let generation = serde_json::json!({"eos_token_id": every});
    std::fs::write(dir.join("generation_config.json"), generation.to_string()).unwrap();
    let ended = run(&chat_args);
    assert_eq!(ended.trim_end_matches('\n'), "");
    let out = ember(&[
        "generate",
        "--checkpoint",
        &fixture(),
        "--prompt",
        "Hi",
        "--chat",
    ]);
    assert_clear_error(&out, &["tiny-gpt2", "no chat template", "--chat"]);
    let _ = std::fs::remove_dir_all(dir);
}

/// A run started from a folder with a chat template keeps it, and its end ids, in every
/// checkpoint and in a Hugging Face export of one, which reply to `--chat` prompts alike.
#[test]
fn fine_tuned_and_exported_models_keep_the_chat_template() {
    let dir = temp("chat-kept");
    let source = dir.join("source");
    std::fs::create_dir_all(&source).unwrap();
    for entry in std::fs::read_dir(fixture()).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, source.join(path.file_name().unwrap())).unwrap();
    }
    let template = "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}\
                    {% if add_generation_prompt %}<assistant>{% endif %}";
    std::fs::write(source.join("chat_template.jinja"), template).unwrap();
    let tokens = serde_json::json!({"bos_token": EOT, "eos_token": EOT});
    std::fs::write(source.join("tokenizer_config.json"), tokens.to_string()).unwrap();
    std::fs::write(
        source.join("generation_config.json"),
        r#"{"eos_token_id": [0, 7]}"#,
    )
    .unwrap();
    let config = dir.join("tune.toml");
    let corpus = repo().join("data/tinyshakespeare.txt");
    std::fs::write(
        &config,
        format!(
            "[model]\ncontext_len = 32\n[data]\npath = {:?}\n\
             [training]\nmax_steps = 1\neval_interval = 10\neval_batches = 1\n",
            corpus.to_str().unwrap()
        ),
    )
    .unwrap();
    let run = dir.join("run");
    let (config, run_dir, source_dir) = (
        config.to_str().unwrap(),
        run.to_str().unwrap(),
        source.to_str().unwrap(),
    );
    ember_ok(&[
        "train",
        "--config",
        config,
        "--init-from",
        source_dir,
        "--out",
        run_dir,
    ]);
    let hf = dir.join("hf");
    let hf_dir = hf.to_str().unwrap();
    ember_ok(&[
        "export",
        "--checkpoint",
        run_dir,
        "--out",
        hf_dir,
        "--format",
        "hf",
    ]);
    let reply = |checkpoint: &str| {
        let args = [
            "generate",
            "--checkpoint",
            checkpoint,
            "--chat",
            "--prompt",
            "Hi",
        ];
        let tail = ["--greedy", "--max-tokens", "6"];
        String::from_utf8(ember_ok(&[&args[..], &tail[..]].concat()).stdout).unwrap()
    };
    assert_eq!(reply(hf_dir), reply(run_dir));
    let latest = std::fs::read_to_string(run.join("latest")).unwrap();
    let checkpoint = run.join(latest.trim());
    let kept = std::fs::read_to_string(checkpoint.join("chat_template.jinja")).unwrap();
    assert_eq!(kept, template);
    for folder in [&checkpoint, &hf] {
        let json = |name: &str| -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(folder.join(name)).unwrap()).unwrap()
        };
        let ids = json("generation_config.json")["eos_token_id"].clone();
        assert_eq!(ids, serde_json::json!([0, 7]), "{}", folder.display());
        assert_eq!(json("tokenizer_config.json")["eos_token"], EOT);
    }
    let settings = std::fs::read_to_string(hf.join("tokenizer_config.json")).unwrap();
    assert!(settings.contains("PreTrainedTokenizerFast"), "{settings}");
    let _ = std::fs::remove_dir_all(dir);
}
