//! The start-up check of cuDNN's attention against ember's fused kernels on the device (so that
//! a wrong graph never trains a model), and what `EMBER_CUDNN_CHECK=report` prints and
//! `EMBER_CUDNN_DUMP` writes for diagnosing a disagreement on a GPU.

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
        Ok(api) => format!("{} (from {})", library::name(api.version), api.folder),
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
        && let Err(e) = dump_all(like, std::path::Path::new(&folder))
    {
        eprintln!("cuDNN dump into {folder}: {e}");
    }
    if std::env::var("EMBER_CUDNN_CHECK").is_ok_and(|v| v == "report") {
        report_all(like);
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

/// Every comparison of [`agrees`] in both forms of the graphs and four shapes, each on its own
/// line of stderr whether it agrees or not, with the first values of the output's rows 1 to 3
/// and of the log-sum-exps (head 0, first sequence) from cuDNN and from the fused kernels: for
/// diagnosing a disagreement on a GPU (`EMBER_CUDNN_CHECK=report`).
fn report_all(like: &CubeTensor) {
    for rng in [false, true] {
        let form = if rng {
            "with dropout nodes"
        } else {
            "plain graphs"
        };
        for (b, t, heads) in [(2, 128, 2), (1, 64, 1), (4, 256, 6), (1, 1024, 12)] {
            let line = match without_dropout(like, b, t, heads, rng) {
                Ok(line) => format!("agrees: {line}"),
                Err(e) => format!("DIFFERS: {e}"),
            };
            eprintln!("cuDNN check, {form}, {b}x{t}, {heads} heads of 64: {line}");
            if let Err(e) = dump(like, b, t, heads, rng) {
                eprintln!("    (no values: {e})");
            }
        }
    }
    match with_dropout(like) {
        Ok(line) => eprintln!("cuDNN check, dropout 0.25: agrees: {line}"),
        Err(e) => eprintln!("cuDNN check, dropout 0.25: DIFFERS: {e}"),
    }
}

/// The first values of [`report_all`]'s line for one case.
fn dump(like: &CubeTensor, b: usize, t: usize, heads: usize, rng: bool) -> Result<(), String> {
    let d = heads * 64;
    let qkv = load(like, pattern(b * t * 3 * d, 1), vec![b, t, 3 * d]);
    let grad = load(like, pattern(b * t * d, 2), vec![b, t, d]);
    let shape = AttentionShape {
        rng,
        ..takes_unchecked(&qkv, heads, 0.0).ok_or("cuDNN does not take the shape")?
    };
    let (out, lse, _) = through_cudnn(like, &qkv, &grad, &shape)?;
    let (fused_out, fused_lse) = crate::cube::attention::fused_forward(
        wide::<CubeBackend>(qkv.clone()),
        check_seed(like),
        heads,
        0.0,
    );
    let (out, lse) = (read(out, "output")?, read(lse, "log-sum-exp")?);
    let (fused_out, fused_lse) = (read(fused_out, "output")?, read(fused_lse, "log-sum-exp")?);
    for row in 1..4.min(t) {
        let at = row * d;
        eprintln!(
            "    output row {row}: cuDNN {:?}, fused {:?}",
            &out[at..at + 4],
            &fused_out[at..at + 4]
        );
    }
    eprintln!(
        "    log-sum-exp rows 0-3: cuDNN {:?}, fused {:?}",
        &lse[..4.min(t)],
        &fused_lse[..4.min(t)]
    );
    Ok(())
}

/// Whether the graphs keep their dropout nodes when nothing is dropped (the form [`agrees`]
/// found to agree).
pub(super) static RNG_WHEN_KEPT: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// `((i * 7919 + seed) mod 61) / 30 - 1` for `i` in `0..n`: values in `[-1, 1]`.
fn pattern(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919 + seed) % 61) as f32 / 30.0 - 1.0)
        .collect()
}

/// `values` of `shape` on `like`'s device, in its type.
fn load(like: &CubeTensor, values: Vec<f32>, shape: Vec<usize>) -> CubeTensor {
    use burn::backend::ops::FloatTensorOps;
    use burn::tensor::TensorData;
    let x = CubeBackend::float_from_data(TensorData::new(values, shape), &like.device);
    float_cast_to::<CubeBackend>(x, like.dtype())
}

/// `x`'s values in `f32`, read back.
fn read(x: CubeTensor, what: &str) -> Result<Vec<f32>, String> {
    burn_cubecl::ops::into_data_sync(wide::<CubeBackend>(x))
        .try_to_vec::<f32>()
        .map_err(|e| format!("reading the {what} back: {e:?}"))
}

/// The seed tensor of the checks (`[1]`, `f32`).
fn check_seed(like: &CubeTensor) -> CubeTensor {
    use burn::backend::ops::FloatTensorOps;
    use burn::tensor::TensorData;
    CubeBackend::float_from_data(TensorData::new(vec![0.375_f32], [1]), &like.device)
}

/// cuDNN's two passes (on the device thread, as the op runs them): output, log-sum-exps,
/// gradient.
fn through_cudnn(
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
fn without_dropout(
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
        let (out, lse) = crate::cube::attention::fused_forward(
            wide::<CubeBackend>(qkv.clone()),
            seed.clone(),
            heads,
            0.0,
        );
        let dqkv = crate::cube::attention::fused_backward(
            wide::<CubeBackend>(qkv.clone()),
            seed.clone(),
            out.clone(),
            lse.clone(),
            wide::<CubeBackend>(grad.clone()),
            heads,
            0.0,
        );
        Ok([
            read(out, "output")?,
            read(lse, "log-sum-exp")?,
            read(dqkv, "gradient")?,
        ])
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
fn with_dropout(like: &CubeTensor) -> Result<String, String> {
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
fn largest(ours: &[f32], reference: &[f32]) -> f32 {
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

/// The inputs and outputs of cuDNN's passes and the fused kernels', in full, as raw
/// little-endian `f32` files in `folder` (`EMBER_CUDNN_DUMP`), for diagnosing a disagreement
/// away from the GPU: per case `NAME.qkv`, `NAME.grad`, `NAME.cudnn.{out,lse,dqkv}` (and
/// `NAME.cudnn-sync.*`, the same with the device waited for around each call), and where the
/// mask is causal `NAME.fused.{out,lse,dqkv}`; `cases.txt` has a line per case (name, `B T H K`,
/// dropout, whether the graphs keep their dropout nodes, whether causal, and what failed).
/// Cases: `V` the identity on 64 positions (the output is the weights), the check's pattern on
/// 2 x 128 with 2 heads, in both forms of the graphs, without the causal mask, and with
/// dropout 0.25.
fn dump_all(like: &CubeTensor, folder: &std::path::Path) -> Result<(), String> {
    use std::io::Write;
    grid(like);
    std::fs::create_dir_all(folder).map_err(|e| e.to_string())?;
    let mut index = String::new();
    // (name, b, t, heads, V and dO the identity, dropout, dropout nodes, causal)
    let cases = [
        ("eye-plain", 1, 64, 1, true, 0.0, false, true),
        ("eye-nodes", 1, 64, 1, true, 0.0, true, true),
        ("eye-noncausal", 1, 64, 1, true, 0.0, false, false),
        ("eye2-plain", 2, 64, 2, true, 0.0, false, true),
        ("pattern-plain", 2, 128, 2, false, 0.0, false, true),
        ("pattern-nodes", 2, 128, 2, false, 0.0, true, true),
        ("pattern-noncausal", 2, 128, 2, false, 0.0, false, false),
        ("eye2-dropout", 2, 64, 2, true, 0.25, false, true),
    ];
    let write = |name: String, values: &[f32]| -> Result<(), String> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(folder.join(name), bytes).map_err(|e| e.to_string())
    };
    for (name, b, t, heads, eye, dropout, rng, causal) in cases {
        let k = 64;
        let d = heads * k;
        let mut values = pattern(b * t * 3 * d, 1);
        let mut grad = pattern(b * t * d, 2);
        if eye {
            for s in 0..b {
                for i in 0..t {
                    for h in 0..heads {
                        for c in 0..k {
                            let one = if c == i { 1.0 } else { 0.0 };
                            values[(s * t + i) * 3 * d + 2 * d + h * k + c] = one;
                            grad[(s * t + i) * d + h * k + c] = one;
                        }
                    }
                }
            }
        }
        let qkv = load(like, values, vec![b, t, 3 * d]);
        let dout = load(like, grad, vec![b, t, d]);
        let mut failed = Vec::new();
        write(format!("{name}.qkv"), &read(qkv.clone(), "qkv")?)?;
        write(format!("{name}.grad"), &read(dout.clone(), "grad")?)?;
        // A failure of an earlier case does not keep cuDNN from this one.
        super::FAILED.store(false, std::sync::atomic::Ordering::Relaxed);
        let Some(shape) = takes_unchecked(&qkv, heads, dropout) else {
            index.push_str(&format!(
                "{name} {b} {t} {heads} {k} {dropout} {rng} {causal} not taken\n"
            ));
            continue;
        };
        let shape = AttentionShape {
            rng,
            causal,
            ..shape
        };
        for (tag, sync) in [("cudnn", false), ("cudnn-sync", true)] {
            super::SYNCHRONIZING.store(sync, std::sync::atomic::Ordering::Relaxed);
            let passes = through_cudnn(like, &qkv, &dout, &shape);
            super::SYNCHRONIZING.store(false, std::sync::atomic::Ordering::Relaxed);
            match passes {
                Ok((out, lse, dqkv)) => {
                    write(format!("{name}.{tag}.out"), &read(out, "output")?)?;
                    write(format!("{name}.{tag}.lse"), &read(lse, "log-sum-exp")?)?;
                    write(format!("{name}.{tag}.dqkv"), &read(dqkv, "gradient")?)?;
                }
                Err(e) => failed.push(format!("{tag}: {e}")),
            }
        }
        if causal {
            let (out, lse) = crate::cube::attention::fused_forward(
                wide::<CubeBackend>(qkv.clone()),
                check_seed(like),
                heads,
                0.0,
            );
            let dqkv = crate::cube::attention::fused_backward(
                wide::<CubeBackend>(qkv.clone()),
                check_seed(like),
                out.clone(),
                lse.clone(),
                wide::<CubeBackend>(dout.clone()),
                heads,
                0.0,
            );
            write(format!("{name}.fused.out"), &read(out, "output")?)?;
            write(format!("{name}.fused.lse"), &read(lse, "log-sum-exp")?)?;
            write(format!("{name}.fused.dqkv"), &read(dqkv, "gradient")?)?;
        }
        index.push_str(&format!(
            "{name} {b} {t} {heads} {k} {dropout} {rng} {causal} {}\n",
            if failed.is_empty() {
                "ok".into()
            } else {
                failed.join("; ")
            }
        ));
    }
    let mut file = std::fs::File::create(folder.join("cases.txt")).map_err(|e| e.to_string())?;
    file.write_all(index.as_bytes())
        .map_err(|e| e.to_string())?;
    eprintln!(
        "cuDNN dump: {} cases written to {}",
        cases.len(),
        folder.display()
    );
    Ok(())
}

/// Where cuDNN's passes agree with the fused kernels over a grid of shapes, and, for the shapes
/// where they do not, which of the heuristics' engines would: a line of stderr each (with
/// `EMBER_CUDNN_DUMP`). The output and log-sum-exps are read right after the forward pass and
/// again after the backward pass (which must not have changed them).
fn grid(like: &CubeTensor) {
    let k = 64;
    for (b, t, heads) in [
        (1, 64, 2),
        (2, 64, 2),
        (16, 64, 2),
        (1, 256, 2),
        (2, 256, 2),
        (16, 256, 12),
        (1, 1024, 12),
        (2, 1024, 2),
        (16, 1024, 12),
        (2, 128, 1),
        (4, 128, 1),
        (3, 128, 2),
    ] {
        let line = grid_case(like, b, t, heads, k).unwrap_or_else(|e| format!("failed: {e}"));
        eprintln!("cuDNN grid {b}x{t}, {heads} heads of {k}: {line}");
    }
    for (b, t, heads) in [(2, 128, 2), (2, 64, 2)] {
        for line in engines(like, b, t, heads, k).unwrap_or_else(|e| vec![format!("failed: {e}")]) {
            eprintln!("cuDNN engines {b}x{t}, {heads} heads of {k}: {line}");
        }
    }
}

/// The largest differences of cuDNN's passes from the fused kernels' on one shape.
fn grid_case(
    like: &CubeTensor,
    b: usize,
    t: usize,
    heads: usize,
    k: usize,
) -> Result<String, String> {
    let d = heads * k;
    let qkv = load(like, pattern(b * t * 3 * d, 1), vec![b, t, 3 * d]);
    let dout = load(like, pattern(b * t * d, 2), vec![b, t, d]);
    super::FAILED.store(false, std::sync::atomic::Ordering::Relaxed);
    let shape = takes_unchecked(&qkv, heads, 0.0).ok_or("not taken")?;
    let seed = check_seed(like);
    let (fo, fl) = crate::cube::attention::fused_forward(
        wide::<CubeBackend>(qkv.clone()),
        seed.clone(),
        heads,
        0.0,
    );
    let fg = crate::cube::attention::fused_backward(
        wide::<CubeBackend>(qkv.clone()),
        seed.clone(),
        fo.clone(),
        fl.clone(),
        wide::<CubeBackend>(dout.clone()),
        heads,
        0.0,
    );
    let (fo, fl, fg) = (read(fo, "output")?, read(fl, "lse")?, read(fg, "gradient")?);
    let (out, lse) = crate::cube::on_device_thread(&like.client, || forward(&qkv, &seed, &shape))
        .flatten()
        .ok_or("the forward pass did not run")?;
    let (o1, l1) = (read(out.clone(), "output")?, read(lse.clone(), "lse")?);
    let dqkv = crate::cube::on_device_thread(&like.client, || {
        backward(&qkv, &seed, &out, &lse, &dout, &shape)
    })
    .flatten()
    .ok_or("the backward pass did not run")?;
    let g = read(dqkv, "gradient")?;
    let (o2, l2) = (read(out, "output")?, read(lse, "lse")?);
    let engine = super::plans_for(&qkv, &shape)
        .map(|p| format!("{}; backward {}", p.forward.engine, p.backward.engine))
        .unwrap_or_default();
    Ok(format!(
        "output {:.4}, lse {:.4}, gradient {:.4}; after the backward pass output {:.4}, lse {:.4} (forward {engine})",
        largest(&o1, &fo),
        largest(&l1, &fl),
        largest(&g, &fg),
        largest(&o2, &o1),
        largest(&l2, &l1),
    ))
}

/// Each forward plan cuDNN finalizes for one shape, against the fused kernels' forward pass.
fn engines(
    like: &CubeTensor,
    b: usize,
    t: usize,
    heads: usize,
    k: usize,
) -> Result<Vec<String>, String> {
    let d = heads * k;
    let qkv = load(like, pattern(b * t * 3 * d, 1), vec![b, t, 3 * d]);
    super::FAILED.store(false, std::sync::atomic::Ordering::Relaxed);
    let shape = takes_unchecked(&qkv, heads, 0.0).ok_or("not taken")?;
    let seed = check_seed(like);
    let (fo, fl) = crate::cube::attention::fused_forward(
        wide::<CubeBackend>(qkv.clone()),
        seed.clone(),
        heads,
        0.0,
    );
    let (fo, fl) = (read(fo, "output")?, read(fl, "lse")?);
    let plans = super::with_handle(&qkv, |handle, _| {
        crate::cudnn::lowering::build_every(
            handle,
            &crate::cudnn::attention_graph::forward_graph(&shape),
        )
    })
    .ok_or("no handle")?
    .map_err(|e| e.to_string())?;
    let mut lines = Vec::new();
    for plan in &plans {
        super::FAILED.store(false, std::sync::atomic::Ordering::Relaxed);
        let ran = crate::cube::on_device_thread(&like.client, || {
            super::forward_with(plan, &qkv, &seed, &shape)
        })
        .flatten();
        lines.push(match ran {
            Some((out, lse)) => format!(
                "{} (workspace {} B): output {:.4}, lse {:.4}",
                plan.engine,
                plan.workspace,
                largest(&read(out, "output")?, &fo),
                largest(&read(lse, "lse")?, &fl)
            ),
            None => format!("{}: did not run", plan.engine),
        });
    }
    Ok(lines)
}
