//! ember's GELUs against Burn's own, forward and backward, on every path they take on flex: a
//! tensor they may overwrite, a shared one, a strided view, a slice, autodiff with and without
//! gradient checkpointing.

use burn::tensor::activation;
use burn::tensor::{Device, Distribution, Tensor, TensorData};
use ember_kernels::{gelu, gelu_tanh, kernels_take};

type Gelu = fn(Tensor<3>) -> Tensor<3>;

/// (ember's, Burn's, name) for both GELUs.
fn pairs() -> [(Gelu, Gelu, &'static str); 2] {
    [
        (gelu, activation::gelu, "exact"),
        (gelu_tanh, activation::gelu_approximate, "tanh"),
    ]
}

fn max_diff<const N: usize>(a: Tensor<N>, b: Tensor<N>) -> f32 {
    (a - b).abs().max().into_scalar::<f32>()
}

fn input(device: &Device) -> Tensor<3> {
    // Wide enough to reach both tails: N(0, 3^2). 93,240 values: more than two of the
    // kernels' 32,768-value tasks, so they run split over threads (the slices below do not).
    Tensor::random([4, 333, 70], Distribution::Normal(0.0, 3.0), device)
}

#[test]
fn forward_matches_burn_and_leaves_shared_inputs_alone() {
    let device = Device::flex();
    let x = input(&device);
    assert!(kernels_take(&x), "flex takes ember's kernel");
    let before = x.clone().into_data();
    for (ours, burns, name) in pairs() {
        let want = burns(x.clone());
        // Shared: `x` is still held, so ember must not write into it.
        let d = max_diff(ours(x.clone()), want.clone());
        assert!(d < 2e-6, "{name}: differs by {d}");
        x.clone().into_data().assert_eq(&before, true);
        // Unique: a fresh copy, which ember may overwrite.
        let fresh = Tensor::<3>::from_data(before.clone(), &device);
        assert!(max_diff(ours(fresh), want) < 2e-6, "{name}");
        // A strided view.
        let transposed = x.clone().swap_dims(1, 2);
        let got = ours(transposed.clone());
        assert_eq!(got.dims(), [4, 70, 333]);
        assert!(max_diff(got, burns(transposed)) < 2e-6, "{name}");
        // A slice with an offset.
        let part = x.clone().slice([1..3, 5..20, 0..70]);
        assert!(max_diff(ours(part.clone()), burns(part)) < 2e-6, "{name}");
    }
}

/// Output and gradient of `sum(f(x) * w)` with respect to `x`, for fixed `x` and `w`.
fn gradient(device: &Device, f: Gelu, x: &TensorData, w: &TensorData) -> (Tensor<3>, Tensor<3>) {
    let x = Tensor::<3>::from_data(x.clone(), device).require_grad();
    assert!(kernels_take(&x), "autodiff flex takes ember's kernel");
    let w = Tensor::<3>::from_data(w.clone(), device);
    let y = f(x.clone());
    let grads = (y.clone() * w).sum().backward();
    let gx = x.grad(&grads).expect("x has a gradient");
    (y.inner(), gx)
}

#[test]
fn backward_matches_burn_with_and_without_checkpointing() {
    let x = input(&Device::flex()).into_data();
    let w = input(&Device::flex()).into_data();
    for device in [
        Device::flex().autodiff(),
        Device::flex().autodiff().gradient_checkpointing(),
    ] {
        for (ours, burns, name) in pairs() {
            let (y, gx) = gradient(&device, ours, &x, &w);
            let (y_burn, gx_burn) = gradient(&device, burns, &x, &w);
            assert!(max_diff(y, y_burn) < 2e-6, "{name}");
            // w ~ N(0, 9): gradients reach ~10, so 1e-5 is a few f32 ulps.
            let d = max_diff(gx.clone(), gx_burn);
            assert!(d < 1e-5, "{name}: gradient differs by {d}");
            assert!(gx.abs().sum().into_scalar::<f32>() > 1.0, "a real gradient");
        }
    }
}

#[test]
fn gradient_flows_through_a_chain() {
    // Inside a larger graph: d/dx sum(f(2x) + x) = 2 f'(2x) + 1.
    let device = Device::flex().autodiff();
    let data = input(&Device::flex()).into_data();
    let chain = |f: Gelu| {
        let x = Tensor::<3>::from_data(data.clone(), &device).require_grad();
        let y = f(x.clone() * 2.0) + x.clone();
        let grads = y.sum().backward();
        x.grad(&grads).expect("x has a gradient")
    };
    for (ours, burns, name) in pairs() {
        assert!(max_diff(chain(ours), chain(burns)) < 1e-5, "{name}");
    }
}
