//! [`crate::sum_of_squares`] on the GPU: the squares of every value of a list of tensors
//! (a step's gradients) summed in one launch per [`MAX_TENSORS`] tensors and one more. Cubes of
//! [`UNITS`] units stride over each tensor of a launch's group in turn and write one partial
//! sum per cube; one cube then adds the partial sums.
//!
//! Why: a model's gradients are dozens of tensors, most of them small. A launch per tensor, each
//! adding to the running total of the one before, made 78 launches a step for nanoGPT's GPU
//! config, 0.88 ms of an H200's 17.3-ms step, almost all of it the launches' fixed cost (the
//! gradients are 42 MB, about 15 us of that GPU's memory bandwidth). Grouped by 8, the same
//! gradients take 8 launches.

use burn::tensor::Tensor;
use burn_cubecl::cubecl::{CubeCount, CubeDim};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

/// Units of a cube (a power of two; every GPU backend allows 256 per cube).
const UNITS: u32 = 256;

/// Values per unit below which fewer cubes are launched.
const PER_UNIT: usize = 16;

/// The most cubes of one launch.
const MAX_CUBES: usize = 512;

/// The most tensors one launch reads: the kernel's tensor slots. Each is a binding; with the
/// partial sums and cubecl's metadata a launch takes 10, which CUDA and Vulkan devices allow
/// (where a device allows fewer, the reference runs).
const MAX_TENSORS: usize = 8;

/// `sum(x^2)` over every value of `xs`, plain `f32` tensors on one CubeCL device (not tracked by
/// autodiff; not under Burn's fusion, whose tensors have no buffer yet); the tensors back
/// otherwise.
///
/// # Shapes
/// - xs: each `[N_i]`
/// - output: `[1]`
pub(crate) fn sum(xs: Vec<Tensor<1>>) -> Result<Tensor<1>, Vec<Tensor<1>>> {
    sum_in_launches_of(xs, MAX_TENSORS)
}

/// [`sum`] with at most `most` tensors per launch.
fn sum_in_launches_of(xs: Vec<Tensor<1>>, most: usize) -> Result<Tensor<1>, Vec<Tensor<1>>> {
    let xs = taken(xs)?;
    let partials = partial_sums(xs, most);
    let out = super::empty(&partials, [1]);
    kernel::sum::launch::<f32>(
        &partials.client.clone(),
        CubeCount::new_1d(1),
        CubeDim::new_1d(UNITS),
        partials.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        UNITS as usize,
    );
    Ok(plain(out))
}

/// [`crate::global_norm`] on the GPU: the partial sums of [`sum`], then one cube that adds them
/// and writes the norm and, with `max_norm`, the clipping factor (where Burn's ops launch six
/// more kernels for the square root and the factor's four operations); the tensors back where
/// [`sum`] would hand them back.
#[allow(clippy::type_complexity)]
pub(crate) fn norm(
    xs: Vec<Tensor<1>>,
    max_norm: Option<f32>,
) -> Result<(Tensor<1>, Option<Tensor<1>>), Vec<Tensor<1>>> {
    let xs = taken(xs)?;
    let partials = partial_sums(xs, MAX_TENSORS);
    let norm = super::empty(&partials, [1]);
    let factor = super::empty(&partials, [1]);
    kernel::norm_and_factor::launch::<f32>(
        &partials.client.clone(),
        CubeCount::new_1d(1),
        CubeDim::new_1d(UNITS),
        partials.into_tensor_arg(),
        norm.clone().into_tensor_arg(),
        factor.clone().into_tensor_arg(),
        max_norm.unwrap_or(0.0),
        UNITS as usize,
        max_norm.is_some(),
    );
    Ok((plain(norm), max_norm.map(|_| plain(factor))))
}

/// `xs` as CubeCL tensors where the kernels take all of them (plain `f32`, one device that
/// binds a launch's tensors); back otherwise.
fn taken(xs: Vec<Tensor<1>>) -> Result<Vec<CubeTensor>, Vec<Tensor<1>>> {
    #[cfg(feature = "fusion")]
    {
        Err(xs)
    }
    #[cfg(not(feature = "fusion"))]
    {
        use crate::GpuKernel;
        use burn::backend::{BackendTensor, DispatchTensorKind};
        let device = match xs.first() {
            Some(x) => x.device(),
            None => return Err(xs),
        };
        let bindings = super::cube_device(&device).map_or(0, |gpu| {
            gpu.client().properties().hardware.max_bindings as usize
        });
        let take = bindings >= MAX_TENSORS + 2
            && xs
                .iter()
                .all(|x| super::gpu_kernel_takes_plain(GpuKernel::Norm, x) && x.device() == device);
        if !take {
            return Err(xs);
        }
        Ok(xs
            .into_iter()
            .map(|x| match x.into_dispatch().kind {
                DispatchTensorKind::Cube(BackendTensor::Float(t)) => t,
                _ => unreachable!("kernels_take_plain checked the tensor's kind"),
            })
            .collect())
    }
}

/// A plain (not tracked) tensor of the dispatch from `x`.
fn plain(x: CubeTensor) -> Tensor<1> {
    // Under fusion the dispatch holds fusion's tensors, and [`taken`] hands none over.
    #[cfg(feature = "fusion")]
    {
        let _ = x;
        unreachable!("no CubeCL tensor is taken under fusion")
    }
    #[cfg(not(feature = "fusion"))]
    {
        use burn::backend::{
            BackendTensor, DispatchAutodiffContext, DispatchTensor, DispatchTensorKind,
        };
        Tensor::from_dispatch(DispatchTensor {
            kind: DispatchTensorKind::Cube(BackendTensor::Float(x)),
            autodiff: DispatchAutodiffContext::Disabled,
        })
    }
}

/// The launches over `xs`, at most `most` tensors each: per group of tensors, each cube's partial
/// sum into its own element of the buffer returned.
fn partial_sums(xs: Vec<CubeTensor>, most: usize) -> CubeTensor {
    let xs: Vec<CubeTensor> = xs.into_iter().map(into_contiguous).collect();
    let client = xs[0].client.clone();
    let per_launch = most.clamp(1, MAX_TENSORS);
    let groups: Vec<(&[CubeTensor], usize)> = xs
        .chunks(per_launch)
        .map(|group| {
            let values: usize = group.iter().map(|x| x.meta.shape().num_elements()).sum();
            let cubes = values
                .div_ceil(UNITS as usize * PER_UNIT)
                .clamp(1, MAX_CUBES);
            (group, cubes)
        })
        .collect();
    let partials = super::empty(&xs[0], [groups.iter().map(|(_, c)| c).sum::<usize>()]);
    let mut offset = 0;
    for (group, cubes) in groups {
        let slot = |i: usize| group.get(i).unwrap_or(&group[0]).clone().into_tensor_arg();
        kernel::sum_of_squares::launch::<f32>(
            &client,
            CubeCount::new_1d(cubes as u32),
            CubeDim::new_1d(UNITS),
            slot(0),
            slot(1),
            slot(2),
            slot(3),
            slot(4),
            slot(5),
            slot(6),
            slot(7),
            partials.clone().into_tensor_arg(),
            offset,
            group.len(),
            UNITS as usize,
        );
        offset += cubes;
    }
    partials
}

mod kernel {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    use crate::cube::reduce_cube;

    /// Cubes of `units` units (a power of two) striding over the first `count` of `x0` ... `x7`
    /// together: unit `u` of cube `c` sums `x[i]^2` for `i = c * units + u`, then every `units *
    /// cubes` further, for each of them; the cube adds its units' sums in shared memory and
    /// writes them to `partials[offset + c]`. (CubeCL 0.11 launches no sequence of tensors: the
    /// slots are written out, the ones past `count` bound to any tensor and never read.)
    #[allow(clippy::too_many_arguments)]
    #[cube(launch)]
    pub(super) fn sum_of_squares<F: Float>(
        x0: &Tensor<F>,
        x1: &Tensor<F>,
        x2: &Tensor<F>,
        x3: &Tensor<F>,
        x4: &Tensor<F>,
        x5: &Tensor<F>,
        x6: &Tensor<F>,
        x7: &Tensor<F>,
        partials: &mut Tensor<F>,
        offset: usize,
        #[comptime] count: usize,
        #[comptime] units: usize,
    ) {
        let u = UNIT_POS_X as usize;
        let cube = CUBE_POS_X as usize;
        let (first, stride) = (cube * units + u, units * CUBE_COUNT_X as usize);
        let mut partial = squares::<F>(x0, first, stride);
        if count > 1 {
            partial += squares::<F>(x1, first, stride);
        }
        if count > 2 {
            partial += squares::<F>(x2, first, stride);
        }
        if count > 3 {
            partial += squares::<F>(x3, first, stride);
        }
        if count > 4 {
            partial += squares::<F>(x4, first, stride);
        }
        if count > 5 {
            partial += squares::<F>(x5, first, stride);
        }
        if count > 6 {
            partial += squares::<F>(x6, first, stride);
        }
        if count > 7 {
            partial += squares::<F>(x7, first, stride);
        }
        let mut sums = Shared::<[F]>::new_slice(units);
        let sum = reduce_cube::<F>(&mut sums, partial, false);
        if u == 0 {
            partials[offset + cube] = sum;
        }
    }

    /// `x[i]^2` summed over `i = first, first + stride, ...`.
    #[cube]
    fn squares<F: Float>(x: &Tensor<F>, first: usize, stride: usize) -> F {
        let mut sum = F::new(0.0);
        let mut i = first;
        while i < x.len() {
            sum += x[i] * x[i];
            i += stride;
        }
        sum
    }

    /// `sum(x)`, one cube of `units` units (a power of two): its sum reaches unit 0.
    #[cube]
    fn cube_sum<F: Float>(x: &Tensor<F>, #[comptime] units: usize) -> F {
        let u = UNIT_POS_X as usize;
        let mut partial = F::new(0.0);
        let mut i = u;
        while i < x.len() {
            partial += x[i];
            i += units;
        }
        let mut sums = Shared::<[F]>::new_slice(units);
        reduce_cube::<F>(&mut sums, partial, false)
    }

    /// `norm[0] = sqrt(sum(x))` and, where `has_factor`, `factor[0] = min(1, max_norm / (norm +
    /// 1e-6))` in the order of the reference's ops (the reciprocal, then the product), one cube
    /// of `units` units.
    #[cube(launch)]
    pub(super) fn norm_and_factor<F: Float>(
        x: &Tensor<F>,
        norm: &mut Tensor<F>,
        factor: &mut Tensor<F>,
        max_norm: f32,
        #[comptime] units: usize,
        #[comptime] has_factor: bool,
    ) {
        let sum = cube_sum::<F>(x, units);
        if UNIT_POS_X == 0 {
            let n = F::sqrt(sum);
            norm[0] = n;
            if has_factor {
                let mut f = F::new(1.0) / (n + F::cast_from(1e-6f32)) * F::cast_from(max_norm);
                // Burn's clamp_max: a NaN stays NaN.
                if f > F::new(1.0) {
                    f = F::new(1.0);
                }
                factor[0] = f;
            }
        }
    }

    /// `out[0] = sum(x)`, one cube of `units` units (a power of two).
    #[cube(launch)]
    pub(super) fn sum<F: Float>(x: &Tensor<F>, out: &mut Tensor<F>, #[comptime] units: usize) {
        let sum = cube_sum::<F>(x, units);
        if UNIT_POS_X == 0 {
            out[0] = sum;
        }
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use burn::tensor::{Device, DeviceKind, Distribution, Tensor};

    use super::{MAX_TENSORS, sum_in_launches_of};
    use crate::{sum_of_squares, sum_of_squares_reference};

    /// Tensors of 0 to 100k values (fewer than a cube's units, not a multiple of them, many
    /// times them), some transposed views (read through a contiguous copy), in launches of 8 (the
    /// most), 1, 3 and 7 tensors, against the reference on wgpu.
    #[test]
    fn equals_the_reference_on_wgpu() {
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        let normal = Distribution::Normal(0.0, 1.0);
        let shapes = [
            (1, 1),
            (3, 7),
            (0, 5),
            (16, 16),
            (37, 19),
            (317, 331),
            (2, 3000),
        ];
        let tensors: Vec<Tensor<1>> = shapes
            .into_iter()
            .chain([(5, 5), (1, 257), (64, 65)])
            .enumerate()
            .map(|(i, (r, c))| {
                let x = Tensor::<2>::random([r, c], normal, &device);
                match i % 2 {
                    1 => x.transpose().reshape([-1]),
                    _ => x.reshape([-1]),
                }
            })
            .collect();
        let want = sum_of_squares_reference(tensors.clone())
            .unwrap()
            .into_scalar::<f32>();
        // About one per value.
        let values: usize = tensors.iter().map(|x| x.dims()[0]).sum();
        assert!(
            (want - values as f32).abs() < 0.05 * values as f32,
            "{want}"
        );
        for most in [MAX_TENSORS, 1, 3, 7] {
            let got = sum_in_launches_of(tensors.clone(), most)
                .unwrap_or_else(|_| panic!("plain wgpu f32 tensors"))
                .into_scalar::<f32>();
            assert!(
                (got - want).abs() <= 1e-5 * want,
                "{most} a launch: {got} vs {want}"
            );
        }
        // The entry point takes the kernel too, and a single tensor.
        let one = vec![tensors[5].clone()];
        let got = sum_of_squares(one.clone()).unwrap().into_scalar::<f32>();
        let want = sum_of_squares_reference(one).unwrap().into_scalar::<f32>();
        assert!((got - want).abs() <= 1e-5 * want, "{got} vs {want}");
    }

    /// The norm and clipping's factor from the last cube against the reference's ops: limits
    /// below the norm (a factor under 1), above it (1), none; the norm alone where no limit.
    #[test]
    fn the_norm_and_the_factor_equal_the_reference_on_wgpu() {
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        let normal = Distribution::Normal(0.0, 1.0);
        let xs: Vec<Tensor<1>> = [(37, 19), (1, 1), (64, 65), (5, 3000)]
            .into_iter()
            .map(|(r, c)| Tensor::<2>::random([r, c], normal, &device).reshape([-1]))
            .collect();
        let value = |t: Tensor<1>| t.into_scalar::<f32>();
        for max_norm in [Some(1.0), Some(1e4), None] {
            let (norm, factor) = super::norm(xs.clone(), max_norm)
                .unwrap_or_else(|_| panic!("plain wgpu f32 tensors"));
            let (want_norm, want_factor) =
                crate::global_norm_reference(xs.clone(), max_norm).expect("tensors");
            let (n, m) = (value(norm), value(want_norm));
            assert!((n - m).abs() <= 1e-5 * m, "{max_norm:?}: norm {n} vs {m}");
            assert!(n > 100.0, "about the root of the values' count: {n}");
            match (factor, want_factor) {
                (Some(f), Some(g)) => {
                    let (f, g) = (value(f), value(g));
                    assert!((f - g).abs() <= 1e-5 * g, "{max_norm:?}: factor {f} vs {g}");
                    assert_eq!(f == 1.0, max_norm == Some(1e4), "{max_norm:?}: {f}");
                }
                (None, None) => assert_eq!(max_norm, None),
                _ => panic!("{max_norm:?}: a factor on one side only"),
            }
        }
        // The entry point takes the kernel path.
        let (n, _) = crate::global_norm(xs.clone(), None).unwrap();
        let (m, _) = crate::global_norm_reference(xs, None).unwrap();
        assert!((value(n) - value(m.clone())).abs() <= 1e-5 * value(m));
    }

    /// What the kernel does not take goes to the reference: tensors tracked by autodiff, an
    /// empty list.
    #[test]
    fn tracked_tensors_and_no_tensors_go_to_the_reference_on_wgpu() {
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        let x = Tensor::<1>::from_floats([1.0, 2.0], &device.clone().autodiff()).require_grad();
        assert!(super::sum(vec![x.clone()]).is_err());
        assert_eq!(sum_of_squares(vec![x]).unwrap().into_scalar::<f32>(), 5.0);
        assert!(super::sum(Vec::new()).is_err());
        assert!(sum_of_squares(Vec::new()).is_none());
    }
}
