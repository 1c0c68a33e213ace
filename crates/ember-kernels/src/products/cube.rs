//! [`crate::matmul`] on CUDA through cuBLAS, with its own autodiff op, so that the
//! products of the backward pass (`dY @ W^T`, `X^T @ dY`) take cuBLAS too, reading the
//! transposed operands in place.
//!
//! The op is `op(a) @ op(b)`, `op` a transpose where asked. Forward, a linear layer asks for
//! none; backward, `C = op(A) op(B)` gives
//! - `dA = dC op(B)^T`, or with `A` transposed `dA = op(B) dC^T`;
//! - `dB = op(A)^T dC`, or with `B` transposed `dB = dC^T op(A)`,
//!
//! each again one product of the op. On other devices (and for a product cuBLAS does not take:
//! `products::cublas::product`) the op runs Burn's `matmul` on the transposed views: the reference
//! the tests compare it with on wgpu.

use crate::cube::autodiff::tracked;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, TensorMetadata, backend_extension};
use burn::tensor::{DType, Device, FloatDType, Tensor, TensorData};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;

/// `a @ b` by cuBLAS (`[M, K] @ [K, N]`, one float type), tracked by autodiff or not, where
/// cuBLAS is loadable (feature `cublas`) and exact there, `EMBER_GPU_KERNELS` has `cublas`, and
/// `a` is on a CUDA device (one that reports its multiprocessors) that records no graph; `(a,
/// b)` back otherwise.
pub(crate) fn matmul(a: Tensor<2>, b: Tensor<2>) -> Result<Tensor<2>, (Tensor<2>, Tensor<2>)> {
    let dtype = a.dtype();
    matmul_into(a, b, dtype)
}

/// [`matmul`] of mixed precision (`ember_model::precision`): `a` (`f32`, or `b`'s type) rounded
/// to `b`'s narrow type inside the op, the product in that type accumulated in `f32`, the result
/// in `out` (`b`'s type or `f32`), under [`matmul`]'s conditions. Under autodiff `a`'s gradient
/// comes in `a`'s type and `b`'s in `b`'s. What it saves against rounding `a`, multiplying and
/// widening the result, each a tracked op: the widening's launch forward (cuBLAS writes its
/// `f32` accumulators as they are, unrounded) and the rounding's backward (`a`'s gradient is
/// written in `f32` by the product that computes it).
pub(crate) fn matmul_into(
    a: Tensor<2>,
    b: Tensor<2>,
    out: DType,
) -> Result<Tensor<2>, (Tensor<2>, Tensor<2>)> {
    if !takes(a.dtype(), b.dtype(), out, &a.device()) {
        return Err((a, b));
    }
    let wide = out == DType::F32 && b.dtype() != DType::F32;
    #[cfg(test)]
    if a.dtype() != b.dtype() || out != b.dtype() {
        tests::TAKEN.set(tests::TAKEN.get() + 1);
    }
    Ok(Tensor::from_dispatch(product_as(a, b, false, false, wide)))
}

/// Whether [`matmul_into`] takes a product of an `a` of type `a_type` and a `b` of type `narrow`
/// into `out` on `device`.
pub(crate) fn takes(a_type: DType, narrow: DType, out: DType, device: &Device) -> bool {
    use crate::GpuStrategy::{Cublas, MixedProducts};
    let mixed = a_type != narrow || out != narrow;
    let types = matches!(narrow, DType::F32 | DType::BF16 | DType::F16)
        && (a_type == narrow || a_type == DType::F32)
        && (out == narrow || out == DType::F32)
        && (!mixed || crate::gpu_kernels::applies(MixedProducts));
    #[cfg(test)]
    if tests::EVERYWHERE.get() {
        return types && crate::on_cubecl(device);
    }
    crate::gpu_kernels::applies(Cublas)
        && types
        && crate::on_cubecl(device)
        && crate::cube::streaming_multiprocessors(device).is_some()
        && loadable_or_warn()
        && !crate::recording::leaves_libraries_out(crate::cube::capturing(device))
        && agrees_on(device, narrow)
}

/// `op(a) @ op(b)` through the op (on any CubeCL device: cuBLAS where it takes the product).
pub(crate) fn product(a: Tensor<2>, b: Tensor<2>, ta: bool, tb: bool) -> FloatTensor<Dispatch> {
    product_as(a, b, ta, tb, false)
}

/// [`product`] with `a` rounded to `b`'s type first, the result in `f32` where `wide`, else in
/// `b`'s type (the op's mixed precision: [`matmul_into`]).
pub(crate) fn product_as(
    a: Tensor<2>,
    b: Tensor<2>,
    ta: bool,
    tb: bool,
    wide: bool,
) -> FloatTensor<Dispatch> {
    <Dispatch as ProductKernels>::product(a.into_dispatch(), b.into_dispatch(), ta, tb, wide)
}

/// Whether cuBLAS can be loaded (never without the `cublas` feature); where it cannot, says so
/// once on stderr: the products then run several times slower.
fn loadable_or_warn() -> bool {
    #[cfg(feature = "cublas")]
    let loadable = super::cublas::loadable();
    #[cfg(not(feature = "cublas"))]
    let loadable = false;
    static WARNED: std::sync::Once = std::sync::Once::new();
    if !loadable {
        WARNED.call_once(|| {
            eprintln!(
                "warning: cuBLAS (libcublas.so from the CUDA toolkit) could not be loaded from the \
                 library path or $CUDA_PATH; matrix products run on cubek's kernels"
            )
        });
    }
    loadable
}

/// Whether cuBLAS's products in `dtype` were found exact on `device`: checked on the first
/// product of that type in the process ([`products_agree`], a few milliseconds); where they were
/// not, says so once on stderr and the products of that type stay cubek's, so that a wrong product
/// never trains a model.
fn agrees_on(device: &Device, dtype: DType) -> bool {
    use std::sync::OnceLock;
    static AGREES: [OnceLock<bool>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    let slot = match dtype {
        DType::F32 => &AGREES[0],
        DType::BF16 => &AGREES[1],
        _ => &AGREES[2],
    };
    *slot.get_or_init(|| match products_agree(device, &[dtype]) {
        Ok(()) => true,
        Err(why) => {
            eprintln!(
                "warning: cuBLAS's {dtype:?} matrix products on this device are wrong ({why}); \
                 they run on cubek's kernels instead"
            );
            false
        }
    })
}

/// The op's products on `device` against exact ones computed on the host, in each of `dtypes`:
/// each operand plain, transposed by the op, and (the right one) a transposed view, and for a
/// narrow type also mixed (`a` in `f32`, rounded by the op, the result in `f32`), with small
/// integers whose products and sums every float type here holds exactly (TF32 keeps 11 bits of
/// mantissa, bf16 8 and f16 11: at most 720 in f32, 180 otherwise), so that any difference is
/// an error, not rounding. The error names the first wrong value, or the failure to read one.
pub(crate) fn products_agree(device: &Device, dtypes: &[DType]) -> Result<(), String> {
    let (m, k, n) = (67, 45, 29);
    for &dtype in dtypes {
        let r = if dtype == DType::F32 { 4 } else { 2 };
        let value = |i: usize, j: usize, seed: usize| {
            ((i * 7 + j * 13 + seed) % (2 * r + 1)) as f32 - r as f32
        };
        // (a transposed by the op, b transposed by the op, b a transposed view, mixed)
        for (ta, tb, view, mixed) in [
            (false, false, false, false),
            (true, false, false, false),
            (false, true, false, false),
            (true, true, false, false),
            (false, false, true, false),
            (false, false, false, true),
            (true, true, false, true),
        ] {
            if mixed && dtype == DType::F32 {
                continue;
            }
            let stored = |rows: usize, cols: usize, transposed: bool, seed: usize| {
                let (sr, sc) = if transposed {
                    (cols, rows)
                } else {
                    (rows, cols)
                };
                let data: Vec<f32> = (0..sr * sc)
                    .map(|x| match transposed {
                        false => value(x / sc, x % sc, seed),
                        true => value(x % sc, x / sc, seed),
                    })
                    .collect();
                Tensor::<2>::from_data(TensorData::new(data, [sr, sc]), device)
                    .cast(FloatDType::from(dtype))
            };
            let a = match mixed {
                true => stored(m, k, ta, 1).cast(FloatDType::F32),
                false => stored(m, k, ta, 1),
            };
            let b = stored(k, n, tb || view, 5);
            let c = match view {
                true => Tensor::<2>::from_dispatch(product(a, b.transpose(), ta, false)),
                false => Tensor::<2>::from_dispatch(product_as(a, b, ta, tb, mixed)),
            };
            if c.dtype() != if mixed { DType::F32 } else { dtype } {
                return Err(format!(
                    "{dtype:?} product, mixed {mixed}: result in {:?}",
                    c.dtype()
                ));
            }
            let got = c
                .cast(FloatDType::F32)
                .into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .map_err(|e| format!("reading a product back: {e:?}"))?;
            for i in 0..m {
                for j in 0..n {
                    let want: f32 = (0..k).map(|p| value(i, p, 1) * value(p, j, 5)).sum();
                    let at = got[i * n + j];
                    if at != want {
                        return Err(format!(
                            "{dtype:?} [{m}, {k}] @ [{k}, {n}], a transposed {ta}, b transposed \
                             {tb}, b a view {view}, mixed {mixed}: ({i}, {j}) is {at}, not {want}"
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

/// The product op on every backend that has it: CubeCL's, Burn's fusion over it, and autodiff
/// over either.
#[backend_extension(Cube, Fusion: cfg(feature = "fusion"), Autodiff)]
pub trait ProductKernels: Backend {
    /// `op(a) @ op(b)`, `op` the transpose where `ta` (for `a`) or `tb` (for `b`) is set, the
    /// identity otherwise: `[M, N]` from `op(a)` `[M, K]` and `op(b)` `[K, N]`. `a` is rounded
    /// to `b`'s type where its own differs, the product is in `b`'s type, and the result in
    /// `f32` where `wide`, else in `b`'s type.
    #[fusion(meta = product_spec)]
    fn product(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        ta: bool,
        tb: bool,
        wide: bool,
    ) -> FloatTensor<Self>;
}

/// The output's shape and type, for fusion (which defers the op).
#[cfg(feature = "fusion")]
fn product_spec(
    a: &burn::backend::fusion::custom::TensorSpec,
    b: &burn::backend::fusion::custom::TensorSpec,
    ta: &bool,
    tb: &bool,
    wide: &bool,
) -> burn::backend::fusion::custom::TensorSpec {
    let [ar, ac] = a.shape.dims::<2>();
    let [br, bc] = b.shape.dims::<2>();
    let m = if *ta { ac } else { ar };
    let n = if *tb { br } else { bc };
    let dtype = if *wide { DType::F32 } else { b.dtype };
    burn::backend::fusion::custom::TensorSpec::new(burn::tensor::Shape::new([m, n]), dtype)
}

impl ProductKernels for CubeBackend {
    fn product(a: CubeTensor, b: CubeTensor, ta: bool, tb: bool, wide: bool) -> CubeTensor {
        type Ops = CubeBackend;
        let narrow = b.dtype();
        let out = if wide { DType::F32 } else { narrow };
        let a = <Ops as FloatTensorOps<Ops>>::float_cast(a, FloatDType::from(narrow));
        let view = |x: CubeTensor, t: bool| match t {
            true => <Ops as FloatTensorOps<Ops>>::float_swap_dims(x, 0, 1),
            false => x,
        };
        let (a, b) = (view(a, ta), view(b, tb));
        #[cfg(feature = "cublas")]
        if let Some(c) = super::cublas::product(&a, &b, out) {
            return c;
        }
        let c = <Ops as FloatTensorOps<Ops>>::float_matmul(a, b);
        <Ops as FloatTensorOps<Ops>>::float_cast(c, FloatDType::from(out))
    }
}

impl<B: ProductKernels, C: CheckpointStrategy> ProductKernels for Autodiff<B, C> {
    fn product(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        ta: bool,
        tb: bool,
        wide: bool,
    ) -> FloatTensor<Self> {
        // `a`'s gradient is written in `a`'s type: `f32` where the op rounds it.
        let a_wide = a.dtype() != b.dtype() && a.dtype() == DType::F32;
        tracked::<B, C, _, _>(Product { ta, tb, a_wide }, [a, b], |[a, b]| {
            let a = B::float_cast(a, FloatDType::from(b.dtype()));
            (B::product(a.clone(), b.clone(), ta, tb, wide), (a, b))
        })
    }
}

/// The autodiff node of the product: which operands were transposed, and whether `a` came in
/// `f32` and was rounded (its gradient then goes back in `f32`).
#[derive(Debug)]
struct Product {
    ta: bool,
    tb: bool,
    a_wide: bool,
}

impl<B: ProductKernels> Backward<B, 2> for Product {
    /// The operands, as the op read them (before `op`; `a` rounded to `b`'s type).
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (a, b) = ops.state;
        let Product { ta, tb, a_wide } = self;
        let [a_node, b_node] = ops.parents;
        // The output's gradient in the products' type, rounded once for both products (a no-op
        // when the output had that type).
        let dc = grads.consume::<B>(&ops.node);
        let dc = B::float_cast(dc, FloatDType::from(b.dtype()));
        if let Some(node) = a_node {
            let da = match ta {
                false => B::product(dc.clone(), b.clone(), false, !tb, a_wide),
                true => B::product(b, dc.clone(), tb, true, a_wide),
            };
            grads.register::<B>(node.id, da);
        }
        if let Some(node) = b_node {
            let db = match tb {
                false => B::product(a, dc, !ta, false, false),
                true => B::product(dc, a, true, ta, false),
            };
            grads.register::<B>(node.id, db);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    std::thread_local! {
        /// Whether [`super::takes`] takes every CubeCL device (this thread's tests on wgpu, where
        /// Burn's product stands in for cuBLAS's), not CUDA's alone.
        pub(crate) static EVERYWHERE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
        /// How many mixed products (of two types) [`super::matmul_into`] took on this thread.
        pub(crate) static TAKEN: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod wgpu_tests {
    use burn::tensor::{Device, DeviceKind, Distribution, Tensor};

    /// The start-up check passes for a correct product (on wgpu the op runs Burn's), plain and
    /// under autodiff, in `f32` and in f16 (mixed products among them).
    #[test]
    fn the_exactness_check_passes_for_burns_products() {
        use burn::tensor::DType;
        let gpu = Device::wgpu(DeviceKind::DefaultDevice);
        for device in [gpu.clone(), gpu.autodiff()] {
            super::products_agree(&device, &[DType::F32, DType::F16]).unwrap();
        }
    }

    /// The op, each operand transposed or not, against Burn's `matmul` of the same views:
    /// output and both gradients, on wgpu with and without checkpointing (where the op runs
    /// Burn's product: this checks the op's shapes and its backward pass, which cuBLAS's
    /// products share on CUDA).
    #[test]
    fn the_op_and_its_gradients_match_burns_matmul() {
        let gpu = Device::wgpu(DeviceKind::DefaultDevice);
        let (m, k, n) = (37, 20, 13);
        let normal = Distribution::Normal(0.0, 1.0);
        for device in [
            gpu.clone().autodiff(),
            gpu.autodiff().gradient_checkpointing(),
        ] {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let a_shape = if ta { [k, m] } else { [m, k] };
                let b_shape = if tb { [n, k] } else { [k, n] };
                let a = Tensor::<2>::random(a_shape, normal, &device);
                let b = Tensor::<2>::random(b_shape, normal, &device);
                let weights = Tensor::<2>::random([m, n], normal, &device);
                let run = |ours: bool| {
                    let (a, b) = (a.clone().require_grad(), b.clone().require_grad());
                    let c = match ours {
                        true => {
                            Tensor::<2>::from_dispatch(super::product(a.clone(), b.clone(), ta, tb))
                        }
                        false => {
                            let av = if ta { a.clone().transpose() } else { a.clone() };
                            let bv = if tb { b.clone().transpose() } else { b.clone() };
                            av.matmul(bv)
                        }
                    };
                    assert_eq!(c.dims(), [m, n], "{ta} {tb}");
                    let grads = (c.clone() * weights.clone()).sum().backward();
                    let ga = a.grad(&grads).expect("a's gradient");
                    let gb = b.grad(&grads).expect("b's gradient");
                    assert_eq!((ga.dims(), gb.dims()), (a_shape, b_shape), "{ta} {tb}");
                    [c.inner().into_data(), ga.into_data(), gb.into_data()]
                        .map(|d| d.try_to_vec::<f32>().unwrap())
                };
                let (ours, theirs) = (run(true), run(false));
                assert_near(&ours, &theirs, 1e-4, 1.0, &format!("{ta} {tb}"));
            }
        }
    }

    /// Output, `a`'s and `b`'s gradients of the op against the reference's, each value within
    /// `relative` of the reference's magnitude (at least `floor`).
    fn assert_near(
        ours: &[Vec<f32>; 3],
        theirs: &[Vec<f32>; 3],
        relative: f32,
        floor: f32,
        case: &str,
    ) {
        for (what, (x, y)) in ["output", "a's gradient", "b's gradient"]
            .iter()
            .zip(ours.iter().zip(theirs))
        {
            for (i, (p, q)) in x.iter().zip(y).enumerate() {
                assert!(
                    (p - q).abs() < relative * q.abs().max(floor),
                    "{what}, {case}, value {i}: {p} vs {q}"
                );
            }
        }
    }

    /// The mixed op (`a` in `f32` rounded to f16 by the op, `b` in f16, the result in `f32`
    /// where wide) against tracked casts around Burn's `matmul`, each operand transposed or not:
    /// output and both gradients, each in its operand's type (`a`'s in `f32`, written by the
    /// product; `b`'s in f16), on wgpu (lavapipe has f16, not bf16; Burn's product stands in for
    /// cuBLAS's).
    #[test]
    fn the_mixed_op_matches_casts_around_burns_matmul() {
        use burn::tensor::{DType, FloatDType};
        let device = Device::wgpu(DeviceKind::DefaultDevice).autodiff();
        let (m, k, n) = (37, 20, 13);
        let normal = Distribution::Normal(0.0, 1.0);
        let half = FloatDType::F16;
        for wide in [true, false] {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let a_shape = if ta { [k, m] } else { [m, k] };
                let b_shape = if tb { [n, k] } else { [k, n] };
                let a = Tensor::<2>::random(a_shape, normal, &device);
                let b = Tensor::<2>::random(b_shape, normal, &device).cast(half);
                let out = if wide { FloatDType::F32 } else { half };
                let weights = Tensor::<2>::random([m, n], normal, &device).cast(out);
                let run = |ours: bool| {
                    let (a, b) = (a.clone().require_grad(), b.clone().require_grad());
                    let c = match ours {
                        true => Tensor::<2>::from_dispatch(super::product_as(
                            a.clone(),
                            b.clone(),
                            ta,
                            tb,
                            wide,
                        )),
                        false => {
                            let av = if ta { a.clone().transpose() } else { a.clone() };
                            let bv = if tb { b.clone().transpose() } else { b.clone() };
                            av.cast(half).matmul(bv).cast(out)
                        }
                    };
                    assert_eq!(c.dims(), [m, n]);
                    assert_eq!(c.dtype(), DType::from(out), "wide {wide}");
                    let grads = (c.clone() * weights.clone())
                        .cast(FloatDType::F32)
                        .sum()
                        .backward();
                    let ga = a.grad(&grads).expect("a's gradient");
                    let gb = b.grad(&grads).expect("b's gradient");
                    assert_eq!((ga.dtype(), gb.dtype()), (DType::F32, DType::F16));
                    [c.inner(), ga, gb].map(|t| {
                        t.cast(FloatDType::F32)
                            .into_data()
                            .try_to_vec::<f32>()
                            .unwrap()
                    })
                };
                // f16 keeps 11 bits: the reference rounds its product's result and `a`'s
                // gradient to f16 where the op keeps them in f32.
                let (ours, theirs) = (run(true), run(false));
                assert_near(
                    &ours,
                    &theirs,
                    2e-3,
                    4.0,
                    &format!("wide {wide}, {ta} {tb}"),
                );
            }
        }
    }
}
