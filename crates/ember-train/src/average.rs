//! Checkpoint averaging: the parameter-wise mean of a run's last checkpoints.
//!
//! Averaging the weights of the last few checkpoints of a run (the transformer paper averages
//! its last 5 or 20) smooths out the noise of the final steps at no training cost. The result
//! is written as a new run folder that `ember translate`, `ember generate` and `ember eval`
//! load like any other; it has no optimizer state, so it cannot be resumed.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Device, Tensor};

use crate::checkpoint::{
    self, CHECKPOINTS, CONFIG_FILE, CheckpointState, MODEL_FILE, OPTIM_FILE, STATE_FILE,
};
use crate::error::{Result, TrainError, write_err};

/// The parameter-wise mean of `models`, which must share one architecture (the first one's
/// parameter ids are kept). Sums in the models' float type, then divides once.
///
/// # Panics
/// If `models` is empty or two models have a different number of parameters.
pub fn average_modules<M: Module>(models: Vec<M>) -> M {
    let count = models.len();
    let mut models = models.into_iter();
    let mut sum = models.next().expect("average of at least one model");
    for model in models {
        let mut flat = Flatten(Vec::new());
        model.visit(&mut flat);
        let mut add = AddNext(flat.0.into_iter());
        sum = sum.map(&mut add);
        assert!(add.0.next().is_none(), "models differ in parameter count");
    }
    sum.map(&mut DivBy(count as f64))
}

/// Collects every float parameter, flattened to one dimension, in visiting order.
struct Flatten(Vec<Tensor<1>>);

impl ModuleVisitor for Flatten {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.0.push(param.val().flatten(0, D - 1));
    }
}

/// Adds the next collected tensor to each float parameter, in the same visiting order.
struct AddNext(std::vec::IntoIter<Tensor<1>>);

impl ModuleMapper for AddNext {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let other = self.0.next().expect("models differ in parameter count");
        param.map(|t| {
            let shape = t.shape();
            t + other.reshape(shape)
        })
    }
}

/// Divides each float parameter by a constant.
struct DivBy(f64);

impl ModuleMapper for DivBy {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        param.map(|t| t.div_scalar(self.0))
    }
}

/// What [`average_checkpoints`] wrote.
#[derive(Debug, Clone)]
pub struct Averaged {
    /// The checkpoint folder written (inside the output run folder).
    pub dir: PathBuf,
    /// The checkpoints averaged, oldest first, with their steps.
    pub sources: Vec<(PathBuf, u64)>,
}

/// Averages checkpoints into the new run folder `out`. Each input is a checkpoint folder or a
/// run folder (all its complete checkpoints); with `last`, only the newest `last` of them are
/// used. All must hold the same model (kind, `[model]` config and tokenizer files). The output
/// checkpoint carries the newest input's step, config and tokenizer.
pub fn average_checkpoints(
    inputs: &[PathBuf],
    last: Option<usize>,
    out: &Path,
    device: &Device,
) -> Result<Averaged> {
    let mut found = BTreeMap::new();
    for input in inputs {
        for dir in expand(input)? {
            let state = checkpoint::read_state(&dir)?;
            found.insert((state.step, dir.clone()), state);
        }
    }
    let mut chosen: Vec<((u64, PathBuf), CheckpointState)> = found.into_iter().collect();
    if let Some(n) = last {
        if n > chosen.len() {
            return Err(TrainError::Checkpoint {
                path: inputs[0].clone(),
                message: format!(
                    "--last {n} asks for more checkpoints than there are ({})",
                    chosen.len()
                ),
            });
        }
        chosen.drain(..chosen.len() - n);
    }
    if chosen.len() < 2 {
        return Err(TrainError::Checkpoint {
            path: inputs[0].clone(),
            message: format!(
                "averaging needs at least two checkpoints, found {} (keep more with training.keep_checkpoints)",
                chosen.len()
            ),
        });
    }
    check_out(out)?;
    let (newest_dir, newest) = {
        let ((_, dir), state) = chosen.last().expect("two or more");
        (dir.clone(), state.clone())
    };
    for ((_, dir), state) in &chosen[..chosen.len() - 1] {
        same_model(&newest_dir, &newest, dir, state)?;
    }
    let dirs: Vec<PathBuf> = chosen.iter().map(|((_, d), _)| d.clone()).collect();
    let state = CheckpointState {
        val_loss: None,
        ..newest.clone()
    };
    let dir = checkpoint::save(out, &state, 1, |tmp| {
        copy_side_files(&newest_dir, tmp)?;
        let path = tmp.join(MODEL_FILE);
        match newest.model_kind.as_str() {
            "decoder_only" => save_mean(&dirs, &path, |d| {
                Ok(crate::lm_source::load_lm(d, device)?.model)
            }),
            "encoder_decoder" => save_mean(&dirs, &path, |d| {
                Ok(crate::translation::load_translator(d, device)?.model)
            }),
            other => Err(TrainError::Checkpoint {
                path: newest_dir.clone(),
                message: format!("cannot average a {}", checkpoint::describe_kind(other)),
            }),
        }
    })?;
    Ok(Averaged {
        dir,
        sources: chosen.into_iter().map(|((s, d), _)| (d, s)).collect(),
    })
}

/// Loads the model of each checkpoint in `dirs` and writes their mean to the weights file `path`.
fn save_mean<M: Module>(
    dirs: &[PathBuf],
    path: &Path,
    load: impl Fn(&Path) -> Result<M>,
) -> Result<()> {
    let models = dirs.iter().map(|d| load(d)).collect::<Result<Vec<M>>>()?;
    average_modules(models)
        .save_file(path)
        .map_err(|e| write_err(path, e))
}

/// The checkpoint folders `input` stands for: itself, or every complete one of a run folder.
fn expand(input: &Path) -> Result<Vec<PathBuf>> {
    if input.join(STATE_FILE).exists() || !input.join(CHECKPOINTS).is_dir() {
        // A checkpoint folder, or not a run folder: resolve() gives the clear error.
        return Ok(vec![checkpoint::resolve(input)?]);
    }
    let dirs = checkpoint::complete(input);
    if dirs.is_empty() {
        return Err(TrainError::Checkpoint {
            path: input.to_path_buf(),
            message: "holds no complete checkpoint".into(),
        });
    }
    Ok(dirs)
}

/// The output must be a new (or empty) folder: averaging never overwrites a run.
fn check_out(out: &Path) -> Result<()> {
    let non_empty = fs::read_dir(out).is_ok_and(|mut entries| entries.next().is_some());
    if non_empty || out.is_file() {
        return Err(TrainError::Write {
            path: out.to_path_buf(),
            message: "already exists; averaging writes a new run folder (pick another --out)"
                .into(),
        });
    }
    Ok(())
}

/// Names of a checkpoint's files other than weights, optimizer state and run state (the config
/// and the tokenizer files), sorted.
fn side_files(dir: &Path) -> Result<Vec<String>> {
    let skip = [MODEL_FILE, OPTIM_FILE, STATE_FILE];
    let mut names: Vec<String> = fs::read_dir(dir)
        .map_err(|e| TrainError::Checkpoint {
            path: dir.to_path_buf(),
            message: format!("cannot list: {e}"),
        })?
        .flatten()
        .filter(|e| e.path().is_file())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| !skip.contains(&n.as_str()))
        .collect();
    names.sort();
    Ok(names)
}

fn copy_side_files(from: &Path, to: &Path) -> Result<()> {
    for name in side_files(from)? {
        let target = to.join(&name);
        fs::copy(from.join(&name), &target).map_err(|e| write_err(&target, e))?;
    }
    Ok(())
}

/// Checks that checkpoint `dir` holds the same kind of model, `[model]` config and tokenizer
/// files as `reference`.
fn same_model(
    reference: &Path,
    reference_state: &CheckpointState,
    dir: &Path,
    state: &CheckpointState,
) -> Result<()> {
    let differs = |what: String| TrainError::Checkpoint {
        path: dir.to_path_buf(),
        message: format!(
            "{what} differs from {}; only checkpoints of one model can be averaged",
            reference.display()
        ),
    };
    if state.model_kind != reference_state.model_kind {
        return Err(differs(format!(
            "its model kind ({})",
            checkpoint::describe_kind(&state.model_kind)
        )));
    }
    if model_section(dir)? != model_section(reference)? {
        return Err(differs("its [model] config".into()));
    }
    let names = side_files(dir)?;
    if names != side_files(reference)? {
        return Err(differs("its set of tokenizer files".into()));
    }
    for name in names.iter().filter(|n| *n != CONFIG_FILE) {
        let read = |d: &Path| fs::read(d.join(name)).ok();
        if read(dir) != read(reference) {
            return Err(differs(format!("its {name}")));
        }
    }
    Ok(())
}

/// The `[model]` table of a checkpoint's config.
fn model_section(dir: &Path) -> Result<Option<toml::Value>> {
    let path = dir.join(CONFIG_FILE);
    let text = fs::read_to_string(&path).map_err(|e| TrainError::Checkpoint {
        path: path.clone(),
        message: format!("cannot read: {e}"),
    })?;
    let value: toml::Table = text.parse().map_err(|e| TrainError::Checkpoint {
        path: path.clone(),
        message: format!("not valid TOML: {e}"),
    })?;
    Ok(value.get("model").cloned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::nn::{Linear, LinearConfig};

    #[test]
    fn mean_of_two_linears_is_the_mean_of_their_weights() {
        let device = Device::flex();
        let a: Linear = LinearConfig::new(3, 2).init(&device);
        let b: Linear = LinearConfig::new(3, 2).init(&device);
        let c: Linear = LinearConfig::new(3, 2).init(&device);
        let values = |l: &Linear| {
            let mut v = l.weight.val().try_into_vec_as::<f32>().unwrap();
            let bias = l.bias.as_ref().unwrap().val();
            v.extend(bias.try_into_vec_as::<f32>().unwrap());
            v
        };
        let (va, vb, vc) = (values(&a), values(&b), values(&c));
        assert_ne!(va, vb);
        let mean = values(&average_modules(vec![a, b, c]));
        assert_eq!(mean.len(), 8);
        for i in 0..8 {
            let want = (va[i] as f64 + vb[i] as f64 + vc[i] as f64) / 3.0;
            assert!(
                (mean[i] as f64 - want).abs() < 1e-6,
                "{i}: {} vs {want}",
                mean[i]
            );
        }
    }
}
