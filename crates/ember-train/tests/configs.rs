//! Every config shipped in `configs/` loads, validates, and names data files that exist, so a
//! README command never starts with a config error.

use std::path::{Path, PathBuf};

use ember_train::config::task_of;
use ember_train::{RunConfig, TranslationRunConfig};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn every_shipped_config_loads_and_its_data_exists() {
    let mut seen = 0;
    for entry in std::fs::read_dir(repo().join("configs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let data: Vec<PathBuf> = match task_of(&path).unwrap().as_str() {
            "lm" => {
                let config = RunConfig::load(&path).unwrap_or_else(|e| panic!("{e}"));
                vec![config.data.path]
            }
            _ => {
                let config = TranslationRunConfig::load(&path).unwrap_or_else(|e| panic!("{e}"));
                let d = config.data;
                vec![d.train_src, d.train_tgt, d.val_src, d.val_tgt]
            }
        };
        for file in data {
            assert!(
                repo().join(&file).is_file(),
                "{} names {}, which is not in the repository",
                path.display(),
                file.display()
            );
        }
        seen += 1;
    }
    assert!(seen >= 6, "only {seen} configs found");
}
