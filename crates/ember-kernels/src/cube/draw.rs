//! [`crate::draw`] on the GPU: a token drawn from `softmax(logits / temperature)` in one
//! launch, a cube per row.
//!
//! Through Burn's ops the draw is about a dozen launches per decoded token (the maximum, the
//! shift and scale, `exp`, `cumsum`, the comparison, the count, the argmax and the masks), more
//! than a whole block of the model takes, and on an H200 temperature sampling ran at 217
//! tokens/s against 284 greedy. Here the cube's units find the row's maximum together, each
//! sums the shifted exponentials of its own contiguous chunk of the row, and one unit then
//! walks the chunks' sums to the chunk where `u` times the total falls and that chunk's values
//! to the token. The cumulative sums are the chunks' prefix plus the chunk's own running sum:
//! non-decreasing, as the reference's are, but rounded differently.
//!
//! Plain tensors only (decoding is never differentiated).

use crate::GpuKernel;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    Autodiff, AutodiffBackend, Backend, Dispatch, TensorMetadata, backend_extension,
};
use burn::tensor::{DType, Int, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

/// Units of a cube: each takes a chunk of `V / UNITS` values (a character model's 65 leave most
/// of them idle; GPT-2's 50257 give each 197).
const UNITS: usize = 256;

/// [`crate::draw`] for a plain `f32` tensor on a CubeCL device; `logits` back otherwise.
///
/// # Shapes
/// - logits: `[B, V]`
/// - output: `[B, 1]`
pub(crate) fn draw(
    logits: Tensor<2>,
    u: f32,
    temperature: f32,
) -> Result<Tensor<2, Int>, Tensor<2>> {
    let [b, v] = logits.dims();
    let take = b > 0 && v > 0 && super::gpu_kernel_takes_plain(GpuKernel::Draw, &logits);
    if !take {
        return Err(logits);
    }
    let index = <Dispatch as DrawKernels>::draw_rows(logits.into_dispatch(), u, temperature);
    // The kernel writes each index as a float (exact below 2^24): the cast gives the device's
    // int type, whichever it is.
    Ok(Tensor::<2>::from_dispatch(index).int())
}

/// [`draw`] by the uniform number `u` `[1]` holds on the device.
pub(crate) fn draw_at(
    logits: Tensor<2>,
    u: &Tensor<1>,
    temperature: f32,
) -> Result<Tensor<2, Int>, Tensor<2>> {
    let [b, v] = logits.dims();
    let take = b > 0
        && v > 0
        && super::gpu_kernel_takes_plain(GpuKernel::Draw, &logits)
        && super::gpu_kernel_takes_plain(GpuKernel::Draw, u);
    if !take {
        return Err(logits);
    }
    let index = <Dispatch as DrawKernels>::draw_rows_at(
        logits.into_dispatch(),
        u.clone().into_dispatch(),
        temperature,
    );
    Ok(Tensor::<2>::from_dispatch(index).int())
}

/// The draw on every backend that has the kernel: CubeCL's, Burn's fusion over it, and autodiff
/// over either (which hands it the inner tensor: it is never differentiated).
#[backend_extension(Cube, Fusion: cfg(feature = "fusion"), Autodiff)]
pub trait DrawKernels: Backend {
    /// The index drawn from each row of `logits` `[B, V]` by `u` at `temperature`, as a float:
    /// `[B, 1]`.
    #[fusion(meta = index_spec)]
    fn draw_rows(logits: FloatTensor<Self>, u: f32, temperature: f32) -> FloatTensor<Self>;

    /// [`DrawKernels::draw_rows`] by the number `u` `[1]` holds.
    #[fusion(meta = index_spec_at)]
    fn draw_rows_at(
        logits: FloatTensor<Self>,
        u: FloatTensor<Self>,
        temperature: f32,
    ) -> FloatTensor<Self>;
}

/// The output's shape `[B, 1]`, for fusion.
#[cfg(feature = "fusion")]
fn index_spec_at(
    logits: &burn::backend::fusion::custom::TensorSpec,
    _u: &burn::backend::fusion::custom::TensorSpec,
    temperature: &f32,
) -> burn::backend::fusion::custom::TensorSpec {
    index_spec(logits, &0.0, temperature)
}

/// The output's shape `[B, 1]`, for fusion (which defers the kernel).
#[cfg(feature = "fusion")]
fn index_spec(
    logits: &burn::backend::fusion::custom::TensorSpec,
    _u: &f32,
    _temperature: &f32,
) -> burn::backend::fusion::custom::TensorSpec {
    let [b, _] = logits.shape.dims::<2>();
    burn::backend::fusion::custom::TensorSpec::new(burn::tensor::Shape::new([b, 1]), logits.dtype)
}

impl DrawKernels for CubeBackend {
    fn draw_rows(logits: CubeTensor, u: f32, temperature: f32) -> CubeTensor {
        draw_launch(logits, Uniform::Host(u), temperature)
    }

    fn draw_rows_at(logits: CubeTensor, u: CubeTensor, temperature: f32) -> CubeTensor {
        assert_eq!(u.dtype(), DType::F32, "draw kernel: an f32 number");
        draw_launch(logits, Uniform::Device(into_contiguous(u)), temperature)
    }
}

/// The draw's uniform number: known when the kernel is launched, or the `[1]` tensor holding it
/// on the device (a captured step, replayed with a new number each time).
#[allow(clippy::large_enum_variant)] // built once per launch, never stored
enum Uniform {
    Host(f32),
    Device(CubeTensor),
}

/// The draw's launch: a cube per row.
fn draw_launch(logits: CubeTensor, u: Uniform, temperature: f32) -> CubeTensor {
    let logits = into_contiguous(logits);
    assert_eq!(logits.dtype(), DType::F32, "draw kernel: f32 only");
    let [b, _] = logits.shape().dims::<2>();
    let out = super::empty(&logits, [b, 1]);
    let client = logits.client.clone();
    let (count, dim) = (super::row_grid(b), CubeDim::new_1d(UNITS as u32));
    let (logits, o) = (logits.into_tensor_arg(), out.clone().into_tensor_arg());
    match u {
        Uniform::Host(u) => {
            kernels::draw_rows::launch::<f32>(&client, count, dim, logits, o, u, temperature)
        }
        Uniform::Device(u) => kernels::draw_rows_at::launch::<f32>(
            &client,
            count,
            dim,
            logits,
            o,
            u.into_tensor_arg(),
            temperature,
        ),
    }
    out
}

impl<B: DrawKernels, C: CheckpointStrategy> DrawKernels for Autodiff<B, C> {
    // Never differentiated: the entry point takes plain tensors only.
    fn draw_rows(logits: FloatTensor<Self>, u: f32, temperature: f32) -> FloatTensor<Self> {
        Self::from_inner(B::draw_rows(Self::inner(logits), u, temperature))
    }

    fn draw_rows_at(
        logits: FloatTensor<Self>,
        u: FloatTensor<Self>,
        temperature: f32,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::draw_rows_at(
            Self::inner(logits),
            Self::inner(u),
            temperature,
        ))
    }
}

mod kernels {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    use super::UNITS;
    use crate::cube::{cube_row, reduce_cube};

    /// `exp((x - max) / t)`, written once so that a chunk's sum and the walk through it round
    /// alike.
    #[cube]
    fn shifted<F: Float>(x: F, max: F, t: F) -> F {
        F::exp((x - max) / t)
    }

    /// Row [`cube_row`] of `logits` `[B, V]` (contiguous): the index drawn by `u` into
    /// `out[row]`. Unit `i` owns values `i * chunk .. (i + 1) * chunk`.
    #[cube(launch)]
    pub(super) fn draw_rows<F: Float>(
        logits: &Tensor<F>,
        out: &mut Tensor<F>,
        u: f32,
        temperature: f32,
    ) {
        draw_row::<F>(logits, out, F::cast_from(u), temperature);
    }

    /// [`draw_rows`] by the number `u[0]`, read on the device (a captured step draws by
    /// whatever the host wrote there before the replay).
    #[cube(launch)]
    pub(super) fn draw_rows_at<F: Float>(
        logits: &Tensor<F>,
        out: &mut Tensor<F>,
        u: &Tensor<F>,
        temperature: f32,
    ) {
        draw_row::<F>(logits, out, u[0], temperature);
    }

    /// The body of [`draw_rows`], for either source of `u`.
    #[cube]
    fn draw_row<F: Float>(logits: &Tensor<F>, out: &mut Tensor<F>, u: F, temperature: f32) {
        let row = cube_row();
        if row < out.shape(0) {
            let unit = UNIT_POS_X as usize;
            let v = logits.shape(1);
            let base = row * v;
            let t = F::cast_from(temperature);
            // The row's maximum, the units reading neighbouring values.
            let mut scratch = Shared::<[F]>::new_slice(UNITS);
            let mut m = F::min_value();
            let mut j = unit;
            while j < v {
                m = F::max(m, logits[base + j]);
                j += UNITS;
            }
            let max = reduce_cube::<F>(&mut scratch, m, true);
            // Each unit's chunk sum.
            // `div_ceil` is not among CubeCL's operations.
            #[allow(clippy::manual_div_ceil)]
            let chunk = (v + UNITS - 1) / UNITS;
            let start = unit * chunk;
            let mut end = start + chunk;
            if end > v {
                end = v;
            }
            let mut sum = F::new(0.0);
            let mut j = start;
            while j < end {
                sum += shifted::<F>(logits[base + j], max, t);
                j += 1;
            }
            let mut sums = Shared::<[F]>::new_slice(UNITS);
            sums[unit] = sum;
            sync_cube();
            if unit == 0 {
                let mut total = F::new(0.0);
                for i in 0..UNITS {
                    total += sums[i];
                }
                let target = u * total;
                // The first chunk whose end passes the target, and the sum before it (the
                // same additions in the same order as the total's).
                let mut before = F::new(0.0);
                // The cube's size at run time (`UNITS`): a variable started from a compile-time
                // value cannot take a run-time one in CubeCL 0.11.
                let units = CUBE_DIM_X as usize;
                let mut crossing = units;
                let mut at_crossing = F::new(0.0);
                for i in 0..UNITS {
                    let after = before + sums[i];
                    if crossing == units && after > target {
                        crossing = i;
                        at_crossing = before;
                    }
                    before = after;
                }
                let mut index = v;
                if crossing < units {
                    // The chunk's first index plus the count of its cumulative sums at or below
                    // the target.
                    index = crossing * chunk;
                    let mut last = index + chunk;
                    if last > v {
                        last = v;
                    }
                    let mut running = F::new(0.0);
                    let mut j = index;
                    while j < last {
                        running += shifted::<F>(logits[base + j], max, t);
                        if at_crossing + running <= target {
                            index += 1;
                        }
                        j += 1;
                    }
                }
                if index >= v {
                    // Rounding put the target at or past the total: the argmax, the first of
                    // tied maxima.
                    index = v;
                    let mut j = 0;
                    while j < v {
                        if index == v && logits[base + j] == max {
                            index = j;
                        }
                        j += 1;
                    }
                }
                out[row] = F::cast_from(index);
            }
        }
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use crate::{draw as draw_op, draw_reference};
    use burn::tensor::{Device, DeviceKind, Distribution, TensorData};

    fn ids(t: Tensor<2, Int>) -> Vec<i64> {
        t.into_data()
            .convert::<i64>()
            .try_into_vec::<i64>()
            .unwrap()
    }

    /// The kernel against Burn's ops on the same logits, and both against a walk in f64:
    /// vocabularies smaller than a cube, not a multiple of it, and GPT-2's; temperatures from
    /// sharp to flat; `u` across `[0, 1)`. Where `u` is clear of a boundary all three agree;
    /// near one, the kernel's token still spans `u` within the sums' rounding.
    #[test]
    fn draws_equal_burns_on_wgpu() {
        use crate::check::{spans, walked};
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        for (v, t, scale) in [
            (1, 1.0, 1.0),
            (7, 1.0, 2.0),
            (65, 0.8, 3.0),
            (257, 2.0, 1.0),
            (1000, 0.3, 3.0),
            (50257, 1.0, 6.0),
        ] {
            let logits = Tensor::<2>::random([1, v], Distribution::Normal(0.0, scale), &device);
            assert!(
                draw(logits.clone(), 0.5, t).is_ok(),
                "V {v}: the kernel takes it"
            );
            let values = logits.to_data().try_into_vec::<f32>().unwrap();
            // Beyond what the f32 sums of either side can be off by.
            let clear = if v > 1000 { 1e-3 } else { 2e-5 };
            let mut compared = 0;
            for k in 0..25 {
                let u = (k as f32 + 0.37) / 25.0;
                let got = ids(draw_op(logits.clone(), u, t));
                // The number read from a device tensor (a replayed step): the same draw.
                let u_at = Tensor::<1>::from_floats([u], &device);
                let at = ids(crate::draw_at(logits.clone(), &u_at, t));
                assert_eq!(at, got, "V {v}, t {t}, u {u}: from the device");
                let (walk, margin) = walked(&values, u, t);
                assert!(
                    spans(&values, u, t, got[0] as usize, clear),
                    "V {v}, t {t}, u {u}: {got:?}"
                );
                if margin > clear {
                    assert_eq!(got, [walk as i64], "V {v}, t {t}, u {u}");
                    let want = ids(draw_reference(logits.clone(), u, t));
                    assert_eq!(got, want, "V {v}, t {t}, u {u}");
                    compared += 1;
                }
            }
            assert!(
                compared >= 15,
                "V {v}: {compared} draws clear of a boundary"
            );
        }
    }

    /// Rows drawn together (each with the same `u`), a `u` past every cumulative sum (the
    /// argmax, the first of tied maxima), a temperature of zero (the argmax), and a row sliced
    /// out of a larger tensor, as decoding takes the last position's logits.
    #[test]
    fn edge_draws_equal_burns_on_wgpu() {
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        let tied = Tensor::<2>::from_data(
            TensorData::new(vec![0.0f32, 2.0, 5.0, 5.0, 1.0, -3.0], [2, 3]),
            &device,
        );
        for (u, t) in [(1.0, 1.0), (0.3, 0.0), (0.0, 1.0), (0.999, 5.0)] {
            assert_eq!(
                ids(draw_op(tied.clone(), u, t)),
                ids(draw_reference(tied.clone(), u, t)),
                "u {u}, t {t}"
            );
        }
        assert_eq!(ids(draw_op(tied.clone(), 1.0, 1.0)), [2, 0]);
        let steps = Tensor::<3>::random([1, 4, 100], Distribution::Normal(0.0, 2.0), &device);
        let last: Tensor<2> = steps.clone().slice([0..1, 3..4, 0..100]).reshape([1, 100]);
        let values = last.to_data().try_into_vec::<f32>().unwrap();
        for k in 0..10 {
            let u = (k as f32 + 0.5) / 10.0;
            let got = ids(draw_op(last.clone(), u, 0.9));
            assert!(
                crate::check::spans(&values, u, 0.9, got[0] as usize, 2e-5),
                "u {u}: {got:?}"
            );
        }
    }

    /// Tracked tensors go back to the caller.
    #[test]
    fn tracked_logits_are_handed_back() {
        let device = Device::wgpu(DeviceKind::DefaultDevice).autodiff();
        let logits = Tensor::<2>::random([1, 10], Distribution::Normal(0.0, 1.0), &device);
        assert!(draw(logits, 0.5, 1.0).is_err());
    }
}
