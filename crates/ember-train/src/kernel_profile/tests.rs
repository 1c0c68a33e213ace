//! The profile's sums, gaps and table, from launches made up by hand.

use super::*;

fn ms(x: u64) -> Duration {
    Duration::from_millis(x)
}

/// A step's launches: (kernel, part, start ms, end ms), timed on the device.
fn step(launches: &[(&'static str, Part, u64, u64)], unmeasured: u64) -> StepLaunches {
    StepLaunches {
        timed: launches
            .iter()
            .map(|&(k, p, a, b)| (k, p, Some((ms(a), ms(b))), ms(b - a)))
            .collect(),
        external: Vec::new(),
        unmeasured,
        methods: vec!["device".into()],
    }
}

/// Work timed outside CubeCL (cuBLAS's products) adds kernel rows and busy time inside the
/// span of the CubeCL kernels around it, not span of its own.
#[test]
fn external_launches_add_busy_time_not_span() {
    use Part::*;
    let mut profile = KernelProfile::new(1);
    let mut launches = step(
        &[
            ("KernelBinop", Gradients, 0, 1),
            ("KernelBinop", Gradients, 9, 10),
        ],
        0,
    );
    launches.external = vec![
        ("cublasGemmEx", Gradients, ms(3)),
        ("cublasGemmEx", Gradients, ms(4)),
    ];
    launches.add_to(&mut profile);
    let rows: Vec<_> = profile
        .kernels
        .iter()
        .map(|k| (k.name.as_str(), k.launches, k.total))
        .collect();
    assert!(rows.contains(&("cublasGemmEx", 2, ms(7))), "{rows:?}");
    assert_eq!(profile.busy(None), ms(9));
    assert_eq!(profile.span, ms(10));
}

#[test]
fn launches_are_summed_by_kernel_and_part_and_the_span_counts_idle_time() {
    use Part::*;
    let mut profile = KernelProfile::new(11);
    // Step 1: two matmuls and an add in the forward and backward passes with 1 ms idle
    // between them, an add in the optimizer; step 2 an add and a matmul, one launch
    // unmeasured.
    step(
        &[
            ("cubecl::matmul::MatmulEntry<f32, Tf32>", Gradients, 2, 5),
            ("KernelBinop", Gradients, 6, 7),
            ("cubecl::matmul::MatmulEntry<f32, Tf32>", Gradients, 7, 10),
            ("KernelBinop", Optimizer, 20, 21),
        ],
        0,
    )
    .add_to(&mut profile);
    step(
        &[
            ("KernelBinop", Gradients, 0, 2),
            ("MatmulEntry", Gradients, 3, 4),
        ],
        1,
    )
    .add_to(&mut profile);
    profile.steps = 2;
    profile.walls = [ms(16), ms(0), ms(4)];
    let profiler = KernelProfiler {
        devices: Vec::new(),
        first: 11,
        last: 12,
        inner: imp::Profiler::new(),
        profile: RefCell::new(Some(profile)),
    };
    let done = profiler.finish().unwrap();
    let rows: Vec<_> = done
        .kernels
        .iter()
        .map(|k| (k.name.as_str(), k.part, k.launches, k.total))
        .collect();
    assert_eq!(
        rows,
        [
            ("MatmulEntry", Gradients, 3, ms(7)),
            ("KernelBinop", Gradients, 2, ms(3)),
            ("KernelBinop", Optimizer, 1, ms(1)),
        ]
    );
    assert_eq!(done.busy(None), ms(11));
    assert_eq!(done.busy(Some(Gradients)), ms(10));
    // Spans: 2..10 and 20..21 in step 1 (each part on its own), 0..4 in step 2.
    assert_eq!(done.span, ms(13));
    assert_eq!(done.launches(None), 6);
    assert_eq!(done.method, "device");
    let text = done.to_string();
    assert!(
        text.starts_with("kernel profile, steps 11-12 (2 steps"),
        "{text}"
    );
    // 11 ms of kernels in 13 ms of span: 85%; 10 ms wall per step; 3.5 launches per step
    // with the unmeasured one.
    assert!(
        text.contains("10.00 ms/step wall; device busy 5.50 ms/step of a 6.50 ms/step span (85%), 4 kernel launches/step"),
        "{text}"
    );
    assert!(
        text.contains("  fwd+bwd      8.00      5.00        2.5"),
        "{text}"
    );
    assert!(
        text.contains("  optim        2.00      0.50        0.5"),
        "{text}"
    );
    assert!(
        text.contains(" 63.6%     3.500        1.5     2333.3  fwd+bwd  MatmulEntry"),
        "{text}"
    );
    assert!(text.contains("1 launches could not be timed"), "{text}");
}

#[test]
fn kernels_past_the_table_are_summed_in_one_line() {
    let mut profile = KernelProfile::new(1);
    let names: Vec<&'static str> = (0..ROWS + 3)
        .map(|i| &*Box::leak(format!("k{i:02}").into_boxed_str()))
        .collect();
    let launches: Vec<_> = names
        .iter()
        .enumerate()
        .map(|(i, &n)| (n, Part::Gradients, 0, 1 + i as u64))
        .collect();
    step(&launches, 0).add_to(&mut profile);
    profile.steps = 1;
    let text = profile.to_string();
    assert!(text.contains("(3 more kernels)"), "{text}");
    // Two summary lines, the parts' header and rows, the kernels' header and rows.
    assert_eq!(text.lines().count(), 2 + 1 + 3 + 1 + ROWS + 1, "{text}");
}
