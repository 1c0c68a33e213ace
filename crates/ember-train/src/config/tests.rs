//! The config's tests: defaults, sections, `--set`, errors naming the key and value.

use super::*;

fn err(text: &str) -> String {
    RunConfig::parse(text).unwrap_err().to_string()
}

#[test]
fn defaults_parse_and_sections_override() {
    let c = RunConfig::parse("[model]\nd_model = 64\n[training]\nlr = 3e-4\n").unwrap();
    assert_eq!(c.model.d_model, 64);
    assert_eq!(c.training.lr, 3e-4);
    assert_eq!(c.training.batch_size, 12);
    let again = RunConfig::parse(&c.to_toml()).unwrap();
    assert_eq!(again, c);
}

fn temp_config(text: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!(
        "ember-override-{}-{}.toml",
        std::process::id(),
        text.len()
    ));
    std::fs::write(&path, text).unwrap();
    path
}

fn set(items: &[&str]) -> Vec<Override> {
    items.iter().map(|s| s.parse().unwrap()).collect()
}

#[test]
fn overrides_set_values_and_errors_name_them() {
    let path = temp_config("[model]\nd_model = 64\n[training]\nlr = 1e-3\n");
    let c = RunConfig::load_with(
        &path,
        &set(&[
            "training.lr=3e-4",
            "model.n_layers=6",
            "training.device=flex",
            "model.positional=\"rotary\"",
            "data.train_fraction = 0.8",
        ]),
    )
    .unwrap();
    assert_eq!(c.training.lr, 3e-4);
    assert_eq!(c.model.n_layers, 6);
    assert_eq!(c.model.d_model, 64, "the file's other values stay");
    assert_eq!(c.training.device, "flex");
    assert_eq!(c.data.train_fraction, 0.8);
    assert!(c.to_toml().contains("lr = 0.0003"), "{}", c.to_toml());

    let err = |items: &[&str]| {
        RunConfig::load_with(&path, &set(items))
            .unwrap_err()
            .to_string()
    };
    let e = err(&["training.lrr=1"]);
    assert!(
        e.starts_with("--set training.lrr=1:") && e.contains("lrr"),
        "{e}"
    );
    let e = err(&["trainin.lr=1"]);
    assert!(
        e.contains("--set trainin.lr=1") && e.contains("trainin"),
        "{e}"
    );
    let e = err(&["training.batch_size=twelve"]);
    assert!(e.contains("--set training.batch_size=twelve"), "{e}");
    let e = err(&["training.lr=-1"]);
    assert!(
        e.contains("--set training.lr=-1") && e.contains("-1"),
        "{e}"
    );
    let e = err(&["model.n_heads=5"]);
    assert!(
        e.contains("--set model.n_heads=5") && e.contains("n_heads"),
        "{e}"
    );
    let e = err(&["training.lr.x=1"]);
    assert!(e.contains("not a section"), "{e}");
    for bad in ["training.lr", "=3", "training..lr=1", "task=translation"] {
        assert!(bad.parse::<Override>().is_err(), "{bad}");
    }
    let _ = std::fs::remove_file(path);
}

#[test]
fn errors_name_the_key_and_the_value() {
    let e = err("[model]\nd_modle = 64\n");
    assert!(e.contains("d_modle") && e.contains("line 2"), "{e}");
    let e = err("[trainin]\nlr = 1\n");
    assert!(e.contains("trainin"), "{e}");
    let e = err("[training]\nbatch_size = \"twelve\"\n");
    assert!(e.contains("twelve") || e.contains("invalid type"), "{e}");
    let e = err("[training]\nlr = nan\n");
    assert!(e.contains("training.lr") && e.contains("NaN"), "{e}");
    let e = err("[training]\nlr = -0.1\n");
    assert!(e.contains("training.lr") && e.contains("-0.1"), "{e}");
    let e = err("[training]\nbatch_size = 0\n");
    assert!(e.contains("training.batch_size"), "{e}");
    let e = err("[training]\nbatch_size = -3\n");
    assert!(e.contains("batch_size") || e.contains("-3"), "{e}");
    let e = err("[model]\nd_model = 30\nn_heads = 4\n");
    assert!(e.contains("n_heads") && e.contains("30"), "{e}");
    let e = err("[model]\ncontext_len = 128\nmax_positions = 64\n");
    assert!(e.contains("context_len") && e.contains("64"), "{e}");
    let e = err("[training]\ndevice = \"tpu\"\n");
    assert!(e.contains("tpu") && e.contains("flex"), "{e}");
    let e = err("this is not toml");
    assert!(e.contains("line 1"), "{e}");
}

#[test]
fn a_resumed_model_names_each_value_it_keeps() {
    let saved = ember_model::EncoderDecoderConfig::default();
    let mut ours = saved.clone();
    assert!(differences(&saved, &ours).is_empty());
    ours.d_model = 2 * saved.d_model;
    ours.dropout = 0.25;
    assert_eq!(
        differences(&saved, &ours),
        vec![
            format!(
                "model.d_model = {} (the config says {})",
                saved.d_model, ours.d_model
            ),
            format!("model.dropout = {:?} (the config says 0.25)", saved.dropout),
        ]
    );
    // A value one side leaves out is shown as unset.
    ours = saved.clone();
    ours.d_ff = Some(7);
    let lines = differences(&saved, &ours);
    assert_eq!(
        lines,
        vec!["model.d_ff = unset (the config says 7)".to_string()]
    );
}

#[test]
fn a_batch_of_more_than_2_to_the_32_tokens_is_refused() {
    let at = |batch: u64| format!("[model]\ncontext_len = 63\n[training]\nbatch_size = {batch}\n");
    assert!(RunConfig::parse(&at(1 << 26)).is_ok());
    assert!(err(&at((1 << 26) + 1)).contains("`training.batch_size` = 67108865 sequences"));
    // Past usize: refused, not wrapped around.
    assert!(err(&at(u64::MAX >> 1)).contains("more than 2^32 tokens a batch"));
}

/// A path that is not there names its key; a relative one also the folder it was looked for
/// in, which is the current folder (not the config file's).
#[test]
fn a_missing_path_names_its_key_and_where_it_was_looked_for() {
    let cwd = std::env::current_dir().unwrap();
    let here = std::fs::read_dir(&cwd).unwrap().flatten().next().unwrap();
    must_exist("data.path", Path::new(&here.file_name())).unwrap();

    let relative = must_exist("data.path", Path::new("no/such.txt"))
        .unwrap_err()
        .to_string();
    let want = format!(
        "`data.path` = no/such.txt: no such file or folder in the current folder {}",
        cwd.display()
    );
    assert!(relative.contains(&want), "{relative}");
    let absolute = must_exist("data.val_src", Path::new("/no/such.de"))
        .unwrap_err()
        .to_string();
    assert!(
        absolute.ends_with("`data.val_src` = /no/such.de: no such file or folder"),
        "{absolute}"
    );
}
