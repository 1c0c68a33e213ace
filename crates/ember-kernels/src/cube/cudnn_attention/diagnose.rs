//! What `EMBER_CUDNN_CHECK=report` prints and `EMBER_CUDNN_DUMP=FOLDER` writes, for diagnosing
//! on a GPU a disagreement of cuDNN's attention with ember's kernels: every comparison of the
//! start-up check with the first values of each side, the inputs and outputs in full, a grid
//! of shapes, and every engine cuDNN's heuristics offer.

use super::check::{
    check_seed, fused_reference, largest, load, pattern, read, takes_unchecked, through_cudnn,
    with_dropout, without_dropout,
};
use super::{backward, forward};
use crate::cube::attention::wide;
use crate::cudnn::attention_graph::AttentionShape;
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;

/// Every comparison of [`agrees`] in both forms of the graphs and four shapes, each on its own
/// line of stderr whether it agrees or not, with the first values of the output's rows 1 to 3
/// and of the log-sum-exps (head 0, first sequence) from cuDNN and from the fused kernels: for
/// diagnosing a disagreement on a GPU (`EMBER_CUDNN_CHECK=report`).
pub(super) fn report_all(like: &CubeTensor) {
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

/// The inputs and outputs of cuDNN's passes and the fused kernels', in full, as raw
/// little-endian `f32` files in `folder` (`EMBER_CUDNN_DUMP`), for diagnosing a disagreement
/// away from the GPU: per case `NAME.qkv`, `NAME.grad`, `NAME.cudnn.{out,lse,dqkv}` (and
/// `NAME.cudnn-sync.*`, the same with the device waited for around each call), and where the
/// mask is causal `NAME.fused.{out,lse,dqkv}`; `cases.txt` has a line per case (name, `B T H K`,
/// dropout, whether the graphs keep their dropout nodes, whether causal, and what failed).
/// Cases: `V` the identity on 64 positions (the output is the weights), the check's pattern on
/// 2 x 128 with 2 heads, in both forms of the graphs, without the causal mask, and with
/// dropout 0.25.
pub(super) fn dump_all(like: &CubeTensor, folder: &std::path::Path) -> Result<(), String> {
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
    let (fo, fl, fg) = fused_reference(&qkv, &seed, Some(&dout), heads)?;
    let fg = fg.expect("a gradient was given");
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
    let (fo, fl, _) = fused_reference(&qkv, &seed, None, heads)?;
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
