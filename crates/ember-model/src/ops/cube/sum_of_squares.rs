//! [`crate::ops::add_sum_of_squares`] on the GPU: one kernel per tensor, cubes of [`UNITS`]
//! units striding over the tensor, partial sums added in shared memory. A small tensor takes
//! one cube, which adds its sum to the running total in the same launch; a large one is split
//! over up to [`MAX_CUBES`] cubes (one cube walking a layer's weights alone took ~73 us a
//! launch on an H100), whose sums a second launch of the same kernel adds to the total.

use crate::ops::GpuKernel;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, TensorMetadata, backend_extension};
use burn::tensor::{DType, Shape, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::cubecl::{CubeCount, CubeDim};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;

/// Units of a cube (a power of two; every GPU backend allows 256 per cube).
const UNITS: u32 = 256;

/// Values per unit below which one cube sums a tensor alone.
const PER_UNIT: usize = 16;

/// The most cubes over one tensor.
const MAX_CUBES: usize = 512;

/// `total + sum(x^2)` where `x` (and `total`) are plain `f32` tensors on a CubeCL device (not
/// tracked by autodiff); the inputs back otherwise.
#[allow(clippy::type_complexity)]
pub(crate) fn add<const D: usize>(
    total: Option<Tensor<1>>,
    x: Tensor<D>,
) -> Result<Tensor<1>, (Option<Tensor<1>>, Tensor<D>)> {
    let total_fits = total
        .as_ref()
        .is_none_or(|t| super::kernels_take_plain(GpuKernel::Norm, t) && t.dims() == [1]);
    if !(super::kernels_take_plain(GpuKernel::Norm, &x) && total_fits) {
        return Err((total, x));
    }
    let total = total.unwrap_or_else(|| Tensor::zeros([1], &x.device()));
    let sum = <Dispatch as SumOfSquaresKernels>::add_sum_of_squares(
        total.into_dispatch(),
        x.reshape([-1]).into_dispatch(),
    );
    Ok(Tensor::from_dispatch(sum))
}

/// The op on every backend that has the kernel: CubeCL's and Burn's fusion over it.
#[backend_extension(Cube, Fusion: cfg(feature = "fusion"))]
pub trait SumOfSquaresKernels: Backend {
    /// `total + sum(x^2)`, `total` `[1]`, `x` `[N]`.
    #[fusion(dtype = total, shape = total)]
    fn add_sum_of_squares(total: FloatTensor<Self>, x: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl SumOfSquaresKernels for CubeBackend {
    fn add_sum_of_squares(total: CubeTensor, x: CubeTensor) -> CubeTensor {
        let [total, x] = [total, x].map(into_contiguous);
        assert_eq!(x.dtype(), DType::F32, "sum of squares kernel: f32 only");
        let new = |n: usize| {
            empty_device_contiguous_dtype(
                x.client.clone(),
                x.device.clone(),
                Shape::new([n]),
                DType::F32,
            )
        };
        let client = x.client.clone();
        let launch = |cubes: usize, total: CubeTensor, x: CubeTensor, out: CubeTensor, square| {
            kernel::sum_of_squares::launch::<f32>(
                &client,
                CubeCount::new_1d(cubes as u32),
                CubeDim::new_1d(UNITS),
                total.into_tensor_arg(),
                x.into_tensor_arg(),
                out.into_tensor_arg(),
                UNITS as usize,
                square,
            );
        };
        let cubes = x
            .shape()
            .num_elements()
            .div_ceil(UNITS as usize * PER_UNIT)
            .clamp(1, MAX_CUBES);
        let out = new(1);
        if cubes == 1 {
            launch(1, total, x, out.clone(), true);
        } else {
            // Each cube's sum of squares, then their sum plus the total.
            let partial = new(cubes);
            launch(cubes, total.clone(), x, partial.clone(), true);
            launch(1, total, partial, out.clone(), false);
        }
        out
    }
}

mod kernel {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    use crate::ops::cube::reduce_cube;

    /// Cubes of `units` units (a power of two) striding over `x` together: unit `u` of cube `c`
    /// sums `x[i]^2` (or with `square` false, `x[i]`) for `i = c * units + u`, then every
    /// `units * cubes` further; the cube adds its units' sums in shared memory and writes them
    /// to `out[c]`, plus `total[0]` when it is the only cube.
    #[cube(launch)]
    pub(super) fn sum_of_squares<F: Float>(
        total: &Tensor<F>,
        x: &Tensor<F>,
        out: &mut Tensor<F>,
        #[comptime] units: usize,
        #[comptime] square: bool,
    ) {
        let u = UNIT_POS_X as usize;
        let cube = CUBE_POS_X as usize;
        let cubes = CUBE_COUNT_X as usize;
        let mut partial = F::new(0.0);
        let mut i = cube * units + u;
        while i < x.len() {
            if square {
                partial += x[i] * x[i];
            } else {
                partial += x[i];
            }
            i += units * cubes;
        }
        let mut sums = Shared::<[F]>::new_slice(units);
        let sum = reduce_cube::<F>(&mut sums, partial, false);
        if u == 0 {
            if cubes == 1 {
                out[0] = total[0] + sum;
            } else {
                out[cube] = sum;
            }
        }
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use burn::tensor::{Device, DeviceKind, Distribution, Tensor};

    use crate::ops::{add_sum_of_squares, add_sum_of_squares_reference};

    /// A running total over tensors of 1 to 100k values (fewer than a cube's units, not a
    /// multiple of them, many times them: one cube, and several with a second launch) against
    /// the reference, on wgpu.
    #[test]
    fn equals_the_reference_on_wgpu() {
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        let normal = Distribution::Normal(0.0, 1.0);
        let tensors: Vec<Tensor<2>> = [(1, 1), (3, 7), (16, 16), (37, 19), (317, 331)]
            .into_iter()
            .map(|(r, c)| Tensor::random([r, c], normal, &device))
            .collect();
        let (mut ours, mut reference) = (None, None);
        for (i, x) in tensors.iter().enumerate() {
            let x = if i % 2 == 1 {
                x.clone().transpose()
            } else {
                x.clone()
            };
            ours = Some(add_sum_of_squares(ours, x.clone()));
            reference = Some(add_sum_of_squares_reference(reference, x));
            let (a, b) = (
                ours.clone().unwrap().into_scalar::<f32>(),
                reference.clone().unwrap().into_scalar::<f32>(),
            );
            assert!(
                (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                "after {i}: {a} vs {b}"
            );
        }
        // About one per value: 105,000 values of unit variance.
        let total = ours.unwrap().into_scalar::<f32>();
        assert!((95_000.0..115_000.0).contains(&total), "{total}");
    }
}
