//! The start-up check of cuDNN's attention against ember's fused kernels on the device, so that
//! a wrong graph never trains a model (what it prints and writes for diagnosing a
//! disagreement: `super::diagnose`).

use super::{backward, forward, library, takes};
use crate::cube::attention::{float_cast_to, wide};
use crate::cudnn::attention_graph::AttentionShape;
use burn::backend::TensorMetadata;
use burn::tensor::DType;
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use std::sync::OnceLock;

/// the attention runs on ember's own path.
pub(super) fn agrees_on(like: &CubeTensor) -> bool {
    static AGREES: [OnceLock<bool>; 2] = [const { OnceLock::new() }; 2];
    let slot = usize::from(like.dtype() == DType::F16);
    *AGREES[slot].get_or_init(|| {
        if std::env::var("EMBER_CUDNN_CHECK").is_ok_and(|v| v == "skip") {
            eprintln!("attention: cuDNN {} flash attention ({:?}), not checked (EMBER_CUDNN_CHECK=skip)", version_name(), like.dtype());
            return true;
        }
        match agrees(like) {
            Ok(report) => {
                eprintln!("attention: cuDNN {} flash attention ({:?}), {report}", version_name(), like.dtype());
                true
            }
            Err(why) => {
                eprintln!(
                    "warning: cuDNN's flash attention disagrees with ember's kernels on this device ({why}); \
                     the attention runs on ember's own path"
                );
                false
            }
        }
    })
}

thread_local! {
    /// Set while the start-up check runs on this thread (its own calls of [`takes`] skip it).
    pub(super) static CHECKING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// cuDNN's version and where it was loaded from.
fn version_name() -> String {
    match library::api() {
        Ok(api) => format!(
            "{} (from {})",
            crate::libraries::version_name(api.version as u64),
            api.folder
        ),
        Err(_) => "?".into(),
    }
}

/// cuDNN's passes against ember's fused kernels on `like`'s device in its type.
///
/// Without dropout (2 sequences of 128 positions, 2 heads of 64; 4 of 256, 6 heads of 64): the
/// output, log-sum-exps and gradient agree within 2% of the largest value (weights and outputs
/// rounded to 8 bits in bf16, the fused kernels computing from the same rounded inputs in
/// `f32`), and the fused kernels give the same values before and after cuDNN ran. The graphs
/// without dropout nodes are tried first, then those with the nodes kept (every element kept):
/// the first form that agrees is the one used from then on ([`RNG_WHEN_KEPT`]).
///
/// With dropout (0.25; 64 positions, `V` the identity so the output is the dropped weights
/// themselves, and `dO` the identity so `dV` is their transpose): each weight kept is the fused
/// kernels' weight times `1 / (1 - p)`, the backward pass drops the same weights as the forward
/// pass, and about a quarter of the weights the causal mask keeps are dropped.
///
/// The error names what differs; the report gives the largest differences.
fn agrees(like: &CubeTensor) -> Result<String, String> {
    if let Ok(folder) = std::env::var("EMBER_CUDNN_DUMP")
        && let Err(e) = super::diagnose::dump_all(like, std::path::Path::new(&folder))
    {
        eprintln!("cuDNN dump into {folder}: {e}");
    }
    if std::env::var("EMBER_CUDNN_CHECK").is_ok_and(|v| v == "report") {
        super::diagnose::report_all(like);
    }
    let mut report = Vec::new();
    let mut failures = Vec::new();
    let mut chosen = None;
    for rng in [false, true] {
        let checked: Result<Vec<String>, String> = [(2, 128, 2), (4, 256, 6)]
            .into_iter()
            .map(|(b, t, heads)| without_dropout(like, b, t, heads, rng))
            .collect();
        match checked {
            Ok(lines) => {
                chosen = Some(rng);
                report.push(lines.join("; "));
                break;
            }
            Err(e) => failures.push(format!(
                "{}: {e}",
                if rng {
                    "with dropout nodes"
                } else {
                    "plain graphs"
                }
            )),
        }
    }
    let Some(rng) = chosen else {
        return Err(failures.join("; "));
    };
    RNG_WHEN_KEPT.store(rng, std::sync::atomic::Ordering::Relaxed);
    if rng {
        report.push(format!(
            "without dropout as the graphs with their dropout nodes (the plain graphs disagreed: {})",
            failures.join("; ")
        ));
    }
    report.push(with_dropout(like)?);
    Ok(format!(
        "checked against ember's kernels: {}",
        report.join("; ")
    ))
}

/// Whether the graphs keep their dropout nodes when nothing is dropped (the form [`agrees`]
/// found to agree).
pub(super) static RNG_WHEN_KEPT: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// `((i * 7919 + seed) mod 61) / 30 - 1` for `i` in `0..n`: values in `[-1, 1]`.
pub(super) fn pattern(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919 + seed) % 61) as f32 / 30.0 - 1.0)
        .collect()
}

/// `values` of `shape` on `like`'s device, in its type.
pub(super) fn load(like: &CubeTensor, values: Vec<f32>, shape: Vec<usize>) -> CubeTensor {
    use burn::backend::ops::FloatTensorOps;
    use burn::tensor::TensorData;
    let x = CubeBackend::float_from_data(TensorData::new(values, shape), &like.device);
    float_cast_to::<CubeBackend>(x, like.dtype())
}

/// `x`'s values in `f32`, read back.
pub(super) fn read(x: CubeTensor, what: &str) -> Result<Vec<f32>, String> {
    burn_cubecl::ops::into_data_sync(wide::<CubeBackend>(x))
        .try_to_vec::<f32>()
        .map_err(|e| format!("reading the {what} back: {e:?}"))
}

/// The seed tensor of the checks (`[1]`, `f32`).
pub(super) fn check_seed(like: &CubeTensor) -> CubeTensor {
    use burn::backend::ops::FloatTensorOps;
    use burn::tensor::TensorData;
    CubeBackend::float_from_data(TensorData::new(vec![0.375_f32], [1]), &like.device)
}

/// cuDNN's two passes (on the device thread, as the op runs them): output, log-sum-exps,
/// gradient.
pub(super) fn through_cudnn(
    like: &CubeTensor,
    qkv: &CubeTensor,
    grad: &CubeTensor,
    shape: &AttentionShape,
) -> Result<(CubeTensor, CubeTensor, CubeTensor), String> {
    let seed = check_seed(like);
    let (out, lse) = crate::cube::on_device_thread(&like.client, || forward(qkv, &seed, shape))
        .flatten()
        .ok_or("the forward pass did not run")?;
    let dqkv = crate::cube::on_device_thread(&like.client, || {
        backward(qkv, &seed, &out, &lse, grad, shape)
    })
    .flatten()
    .ok_or("the backward pass did not run")?;
    Ok((out, lse, dqkv))
}

/// The no-dropout comparison of [`agrees`] on `b` sequences of `t` positions, `heads` heads of
/// 64, the graphs with their dropout nodes where `rng`.
pub(super) fn without_dropout(
    like: &CubeTensor,
    b: usize,
    t: usize,
    heads: usize,
    rng: bool,
) -> Result<String, String> {
    let k = 64;
    let d = heads * k;
    let qkv = load(like, pattern(b * t * 3 * d, 1), vec![b, t, 3 * d]);
    let grad = load(like, pattern(b * t * d, 2), vec![b, t, d]);
    let shape = AttentionShape {
        rng,
        ..takes_unchecked(&qkv, heads, 0.0).ok_or("cuDNN does not take the check's shape")?
    };
    let seed = check_seed(like);
    let fused = || -> Result<[Vec<f32>; 3], String> {
        let (out, lse, dqkv) = fused_reference(&qkv, &seed, Some(&grad), heads)?;
        Ok([out, lse, dqkv.expect("a gradient was given")])
    };
    let before = fused()?;
    let (out, lse, dqkv) = through_cudnn(like, &qkv, &grad, &shape)?;
    let ours = [
        read(out, "output")?,
        read(lse, "log-sum-exp")?,
        read(dqkv, "gradient")?,
    ];
    let after = fused()?;
    let mut report = Vec::new();
    for (i, what) in ["output", "log-sum-exp", "gradient"]
        .into_iter()
        .enumerate()
    {
        if let Some(e) = difference(&after[i], &before[i], 0.0) {
            return Err(format!(
                "the fused kernels' {what} changed after cuDNN ran: {e}"
            ));
        }
        if let Some(e) = difference(&ours[i], &before[i], 0.02) {
            return Err(format!("{b}x{t}, {heads} heads, {what}: {e}"));
        }
        report.push(format!(
            "{what} within {:.2}%",
            100.0 * largest(&ours[i], &before[i])
        ));
    }
    Ok(format!("{b}x{t}, {heads} heads: {}", report.join(", ")))
}

/// The dropout comparison of [`agrees`].
pub(super) fn with_dropout(like: &CubeTensor) -> Result<String, String> {
    let (b, t, heads, k, p) = (2usize, 64usize, 2usize, 64usize, 0.25f32);
    let d = heads * k;
    let mut values = pattern(b * t * 3 * d, 3);
    let mut identity = vec![0f32; b * t * d];
    for s in 0..b {
        for i in 0..t {
            for h in 0..heads {
                for c in 0..k {
                    let one = if c == i { 1.0 } else { 0.0 };
                    values[(s * t + i) * 3 * d + 2 * d + h * k + c] = one;
                    identity[(s * t + i) * d + h * k + c] = one;
                }
            }
        }
    }
    let qkv = load(like, values, vec![b, t, 3 * d]);
    let eye = load(like, identity, vec![b, t, d]);
    let shape = takes_unchecked(&qkv, heads, p).ok_or("cuDNN does not take the check's shape")?;
    // The weights themselves: the fused kernels' output with `V = I` and no dropout.
    let (plain, _) = crate::cube::attention::fused_forward(
        wide::<CubeBackend>(qkv.clone()),
        check_seed(like),
        heads,
        0.0,
    );
    let plain = read(plain, "weights")?;
    let (out, _, dqkv) = through_cudnn(like, &qkv, &eye, &shape)?;
    let (weights, grads) = (
        read(out, "dropped weights")?,
        read(dqkv, "gradient with dropout")?,
    );
    let rescale = 1.0 / (1.0 - p);
    let (mut kept, mut dropped) = (0usize, 0usize);
    for s in 0..b {
        for h in 0..heads {
            for i in 0..t {
                for j in 0..t {
                    // Output row i, column j: query i's dropped weight of key j; dV row j,
                    // column i: the same weight as the backward pass drops it.
                    let at = (s * t + i) * d + h * k + j;
                    let (forward, weight) = (weights[at], plain[at]);
                    let backward = grads[(s * t + j) * 3 * d + 2 * d + h * k + i];
                    if (forward - backward).abs() > 0.02 * forward.abs().max(0.05) {
                        return Err(format!(
                            "with dropout, query {i}'s weight of key {j} (head {h}) is {forward} forward and {backward} backward"
                        ));
                    }
                    if forward != 0.0
                        && (forward - weight * rescale).abs()
                            > 0.02 * (weight * rescale).abs().max(0.05)
                    {
                        return Err(format!(
                            "with dropout, query {i}'s kept weight of key {j} (head {h}) is {forward}, the fused kernels' {} after rescaling",
                            weight * rescale
                        ));
                    }
                    if j <= i {
                        match forward == 0.0 {
                            true => dropped += 1,
                            false => kept += 1,
                        }
                    } else if forward != 0.0 {
                        return Err(format!("query {i} sees the later key {j} ({forward})"));
                    }
                }
            }
        }
    }
    let share = dropped as f64 / (kept + dropped) as f64;
    if !(0.2..0.3).contains(&share) {
        return Err(format!(
            "dropout 0.25 dropped {:.1}% of the weights",
            100.0 * share
        ));
    }
    Ok(format!(
        "dropout: kept weights rescaled, the same masks forward and backward ({:.1}% dropped)",
        100.0 * share
    ))
}

/// Where `ours` differs from `reference` by more than `tolerance` times the reference's largest
/// magnitude (at least 1): how many values, the first and the largest.
fn difference(ours: &[f32], reference: &[f32], tolerance: f32) -> Option<String> {
    let scale = reference.iter().fold(1f32, |m, v| m.max(v.abs()));
    let bad: Vec<usize> = (0..ours.len().min(reference.len()))
        // A NaN is never close.
        .filter(|&i| {
            let close = (ours[i] - reference[i]).abs() <= tolerance * scale;
            !close
        })
        .collect();
    let &first = bad.first()?;
    Some(format!(
        "{} of {} values differ, the first at {first}: {} against {}; the largest difference {:.3} of the largest value",
        bad.len(),
        ours.len(),
        ours[first],
        reference[first],
        largest(ours, reference)
    ))
}

/// The largest difference of `ours` from `reference`, relative to the reference's largest
/// magnitude (at least 1).
/// The output, the log-sum-exp and the projection's gradient (where computed), read back.
pub(super) type Passes = (Vec<f32>, Vec<f32>, Option<Vec<f32>>);

/// The fused kernels' passes without dropout, read back: the output, the log-sum-exp and (given
/// the output's gradient `grad`) the projection's gradient, the reference cuDNN is held to.
pub(super) fn fused_reference(
    qkv: &CubeTensor,
    seed: &CubeTensor,
    grad: Option<&CubeTensor>,
    heads: usize,
) -> Result<Passes, String> {
    let (out, lse) = crate::cube::attention::fused_forward(
        wide::<CubeBackend>(qkv.clone()),
        seed.clone(),
        heads,
        0.0,
    );
    let dqkv = match grad {
        Some(grad) => Some(read(
            crate::cube::attention::fused_backward(
                wide::<CubeBackend>(qkv.clone()),
                seed.clone(),
                out.clone(),
                lse.clone(),
                wide::<CubeBackend>(grad.clone()),
                heads,
                0.0,
            ),
            "gradient",
        )?),
        None => None,
    };
    Ok((read(out, "output")?, read(lse, "log-sum-exp")?, dqkv))
}

pub(super) fn largest(ours: &[f32], reference: &[f32]) -> f32 {
    let scale = reference.iter().fold(1f32, |m, v| m.max(v.abs()));
    (ours.iter().zip(reference)).fold(0f32, |m, (a, b)| m.max((a - b).abs() / scale))
}

/// [`takes`] without the start-up check (for the check itself).
pub(super) fn takes_unchecked(
    qkv: &CubeTensor,
    heads: usize,
    dropout: f32,
) -> Option<AttentionShape> {
    CHECKING.with(|c| {
        let before = c.replace(true);
        let shape = takes(qkv, heads, dropout);
        c.set(before);
        shape
    })
}
