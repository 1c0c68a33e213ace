//! Helpers shared by the binary's integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn ember(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(args)
        .current_dir(repo())
        .output()
        .expect("ember runs")
}

pub fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ember-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `ember` and asserts it succeeded, showing its stderr if not.
pub fn ember_ok(args: &[&str]) -> Output {
    let out = ember(args);
    assert!(
        out.status.success(),
        "ember {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Asserts a failed run with one `error:` line naming every `needle`, and no panic.
pub fn assert_clear_error(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure, stderr: {stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "want one error line, got: {stderr}");
    for needle in needles {
        assert!(
            errors[0].contains(needle),
            "{needle:?} missing from: {}",
            errors[0]
        );
    }
    assert!(
        !stderr.contains("panicked") && !stderr.contains("RUST_BACKTRACE"),
        "{stderr}"
    );
}

/// Every parameter of the newest checkpoint in `dir`, flattened.
pub fn params(dir: &Path) -> Vec<f32> {
    use burn::module::{Module, ModuleVisitor, Param};
    use burn::tensor::Tensor;
    struct Collect(Vec<f32>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.0.extend(p.val().try_into_vec_as::<f32>().unwrap());
        }
    }
    let lm = ember_train::load_lm(dir, &burn::tensor::Device::flex()).unwrap();
    let mut collect = Collect(Vec::new());
    lm.model.visit(&mut collect);
    collect.0
}

/// Sends `signal` (`TERM`, `KILL`, ...) to process `pid`.
pub fn signal(pid: &str, signal: &str) {
    let sent = Command::new("kill")
        .args([&format!("-{signal}"), pid])
        .status()
        .unwrap();
    assert!(sent.success(), "kill -{signal} {pid}");
}

/// The step of the `interrupted at step N: saved ...` line of a stopped run's stderr, and the
/// line.
pub fn interrupted_step(stderr: &str) -> (u64, &str) {
    let line = stderr
        .lines()
        .find(|l| l.starts_with("interrupted at step"))
        .unwrap_or_else(|| panic!("no 'interrupted' line: {stderr}"));
    let step = line["interrupted at step ".len()..]
        .split(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    (step, line)
}
