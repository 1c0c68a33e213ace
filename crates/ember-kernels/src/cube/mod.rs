//! ember's GPU kernels, on Burn's CubeCL backend (wgpu / Vulkan, CUDA; feature `wgpu`,
//! `vulkan` or `cuda`).
//!
//! Each op is a method of a backend extension trait (Burn's `#[backend_extension]`): its
//! CubeCL kernels are implemented for [`burn_cubecl::CubeBackend`]; Burn generates the
//! deferred version for its fusion backend (feature `fusion`) and the routing through
//! `Dispatch`; ember writes the autodiff op (the kernels' own backward pass) once for every
//! backend that has the kernels. The reference implementation of each op (`crate::ops`) stays
//! what every other backend runs, and what the tests compare these kernels with.

pub(crate) mod adamw;
pub(crate) mod adamw_groups;
pub(crate) mod attention;
pub(crate) mod attention_products;
pub(crate) mod autodiff;
pub(crate) mod cache_write;
pub(crate) mod cross_entropy;
#[cfg(feature = "cudnn")]
pub(crate) mod cudnn_attention;
pub(crate) mod draw;
pub(crate) mod dropout;
pub(crate) mod embedding;
pub(crate) mod gated;
pub(crate) mod gelu;
pub(crate) mod hashed_mask;
pub(crate) mod layer_norm;
pub(crate) mod step_inputs;
pub(crate) mod sum_of_squares;
pub(crate) mod weight_copies;

use crate::gpu_kernels::{self, GpuKernel};
use burn::backend::ops::IntTensorOps;
use burn::backend::{BackendTensor, DispatchTensorKind, TensorMetadata};
use burn::tensor::{DType, IntDType, Shape, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::cubecl::{CubeCount, CubeDim, calculate_cube_count_elemwise};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;

/// `device`'s CubeCL device (under autodiff or not), or `None` on other backends.
fn cube_device(device: &burn::tensor::Device) -> Option<&burn_cubecl::CubeDevice> {
    use burn::backend::DispatchDevice;
    fn of(device: &DispatchDevice) -> Option<&burn_cubecl::CubeDevice> {
        match device {
            DispatchDevice::Cube(gpu) => Some(gpu),
            DispatchDevice::Autodiff(inner) => of(inner),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }
    of(device.as_dispatch())
}

/// The number of multiprocessors of `device`'s GPU, where its runtime reports it (CUDA and
/// ROCm do, wgpu does not); `None` on other backends.
pub(crate) fn streaming_multiprocessors(device: &burn::tensor::Device) -> Option<u32> {
    let client = cube_device(device)?.client();
    client.properties().hardware.num_streaming_multiprocessors
}

/// Whether `device`'s CubeCL client is recording a graph on this thread (a replayed decoding
/// step being captured); false on other backends.
pub(crate) fn capturing(device: &burn::tensor::Device) -> bool {
    cube_device(device).is_some_and(|gpu| gpu.client().is_capturing())
}

/// Whether `kernel` is on ([`crate::gpu_kernels`]) and takes `x`: an `f32` tensor on a
/// CubeCL device, tracked by autodiff or not.
pub(crate) fn gpu_kernel_takes<const D: usize>(kernel: GpuKernel, x: &Tensor<D>) -> bool {
    gpu_kernels::uses(kernel) && cube_f32(x)
}

/// Whether `x` is an `f32` tensor of CubeCL's backend (not fusion's), tracked by autodiff or not.
pub(crate) fn cube_f32<const D: usize>(x: &Tensor<D>) -> bool {
    let x = x.clone().into_dispatch();
    match &x.kind {
        DispatchTensorKind::Cube(BackendTensor::Float(t)) => t.dtype() == DType::F32,
        DispatchTensorKind::Autodiff(inner) => matches!(
            inner.as_ref(),
            DispatchTensorKind::Cube(BackendTensor::Autodiff(t)) if t.primitive().dtype() == DType::F32
        ),
        #[allow(unreachable_patterns)]
        _ => false,
    }
}

/// Whether `kernel` takes `x` and it is not tracked by autodiff (optimizer state, decoding).
pub(crate) fn gpu_kernel_takes_plain<const D: usize>(kernel: GpuKernel, x: &Tensor<D>) -> bool {
    gpu_kernel_takes(kernel, x) && !x.device().is_autodiff()
}

/// `task` run on CubeCL's device thread of `client` in one blocking round trip, where client
/// calls inside it (launches, allocations, buffer lookups) run at once instead of each being
/// queued or waited for. Where the device thread cannot be taken, `task` runs here; `None`
/// where it was taken and failed there (a panic inside), and was not run again.
pub(crate) fn on_device_thread<R: Send + 'static>(
    client: &burn_cubecl::cubecl::client::Client,
    task: impl FnOnce() -> R + Send,
) -> Option<R> {
    // The device thread runs the task under the caller's policy (a scoped one included).
    let policy = crate::gpu_kernels::policy();
    let mut task = Some(move || {
        let _inside = InsideTask::enter();
        crate::gpu_kernels::with_policy(policy, task)
    });
    match client.exclusive(|| task.take().map(|task| task())) {
        Ok(Some(done)) => Some(done),
        _ => task.take().map(|task| task()),
    }
}

std::thread_local! {
    /// Whether this thread is running an [`on_device_thread`] task.
    static INSIDE_TASK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks this thread as running an [`on_device_thread`] task while alive.
struct InsideTask(bool);

impl InsideTask {
    fn enter() -> Self {
        InsideTask(INSIDE_TASK.replace(true))
    }
}

impl Drop for InsideTask {
    fn drop(&mut self) {
        INSIDE_TASK.set(self.0);
    }
}

/// Whether this thread is running an [`on_device_thread`] task (whose client calls run at
/// once, in the task's order: work queued for later would run after them).
#[cfg_attr(not(feature = "cublas"), allow(dead_code))]
pub(crate) fn inside_device_task() -> bool {
    INSIDE_TASK.get()
}

/// A new contiguous `f32` tensor of `shape` on `like`'s device.
pub(crate) fn empty(like: &CubeTensor, shape: impl Into<Shape>) -> CubeTensor {
    empty_of(like, shape, DType::F32)
}

/// A new contiguous tensor of `shape` and `dtype` on `like`'s device.
pub(crate) fn empty_of(like: &CubeTensor, shape: impl Into<Shape>, dtype: DType) -> CubeTensor {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        shape.into(),
        dtype,
    )
}

/// Ids (token ids, targets) as a contiguous `i32` tensor, the type ember's kernels read them in
/// (backends may hold ints as `i64`).
pub(crate) fn ids_i32(ids: CubeTensor) -> CubeTensor {
    let ids = match ids.dtype() == DType::I32 {
        true => ids,
        false => CubeBackend::int_cast(ids, IntDType::I32),
    };
    into_contiguous(ids)
}

/// Cubes and units for one unit per each of `units` rows or elements.
pub(crate) fn launch_size(like: &CubeTensor, units: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new(&like.client, units);
    (calculate_cube_count_elemwise(&like.client, units, dim), dim)
}

/// Elements per vector of an elementwise kernel over the `n` elements of the contiguous `x`: the
/// widest size the device reads and writes at once (16 bytes: 4 `f32` or 8 bf16 values on CUDA;
/// lavapipe's widest is 4 values of either) that divides `n` and whose bytes divide where `x`
/// starts in its buffer (Burn makes a view that starts mid-allocation only at the device's
/// memory alignment, 256 bytes on lavapipe; the check keeps any other start correct), else 1. A
/// unit then moves one vector per access instead of one value. bf16 and f16 tensors take vectors
/// only while `narrow-vectors` is on ([`gpu_kernels::GpuStrategy::NarrowVectors`]).
pub(crate) fn elementwise_lanes(x: &CubeTensor, n: usize) -> usize {
    let vectors = match x.dtype() {
        DType::F32 => true,
        DType::BF16 | DType::F16 => gpu_kernels::applies(gpu_kernels::GpuStrategy::NarrowVectors),
        _ => false,
    };
    if !vectors {
        return 1;
    }
    let start = x.handle.offset_start.unwrap_or(0);
    let size = x.dtype().size();
    x.client
        .io_optimized_vector_sizes(size)
        .find(|&w| n.is_multiple_of(w) && start.is_multiple_of((w * size) as u64))
        .unwrap_or(1)
}

/// Units of a cube that works on one row ([`row_cubes`]): a warp. Wider cubes (up to 128 for
/// rows of 128 or more) made LayerNorm 3x slower on lavapipe, which runs a cube's units one
/// after another and pays for every synchronisation of the reductions.
pub(crate) const ROW_UNITS: usize = 32;

/// One cube of [`ROW_UNITS`] units per each of `rows` rows, laid out in a [`row_grid`].
pub(crate) fn row_cubes(rows: usize) -> (CubeCount, CubeDim) {
    (row_grid(rows), CubeDim::new_1d(ROW_UNITS as u32))
}

/// One cube per each of `rows` rows, laid out in a grid whose rows [`cube_row`] numbers: a
/// launch has at most 65535 cubes a side on some backends (Vulkan's guaranteed minimum; a
/// one-dimensional launch of more fails there), so lines of at most 32768 cubes.
pub(crate) fn row_grid(rows: usize) -> CubeCount {
    let x = rows.clamp(1, 32768);
    CubeCount::new_2d(x as u32, rows.div_ceil(x) as u32)
}

/// The row of this cube in a [`row_grid`] launch (past the last row in the grid's last line:
/// such cubes end at once).
#[cube]
pub(crate) fn cube_row() -> usize {
    CUBE_POS_Y as usize * CUBE_COUNT_X as usize + CUBE_POS_X as usize
}

/// The sum (or with `max`, the maximum) of every unit's `value` over a one-dimensional cube
/// whose size is a power of two, returned to every unit: a halving tree through `scratch` (one
/// slot per unit), synchronised at each level and before returning, so `scratch` can be used
/// again at once.
#[cube]
pub(crate) fn reduce_cube<F: Float>(
    scratch: &mut Shared<[F]>,
    value: F,
    #[comptime] max: bool,
) -> F {
    let u = UNIT_POS_X as usize;
    scratch[u] = value;
    sync_cube();
    // The halving count starts from the runtime cube size: a mutable variable started from a
    // compile-time value fails CubeCL 0.11's verification ("expected operand type cube.ptr, but
    // found cube.index"; docs/burn-findings.md, 20).
    let mut half = CUBE_DIM_X as usize / 2;
    while half > 0 {
        if u < half {
            if max {
                scratch[u] = F::max(scratch[u], scratch[u + half]);
            } else {
                scratch[u] = scratch[u] + scratch[u + half];
            }
        }
        sync_cube();
        half /= 2;
    }
    let result = scratch[0];
    sync_cube();
    result
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use burn::tensor::{Device, DeviceKind, Tensor};

    /// A task handed to the device thread knows it runs there (cuBLAS's calls made inside one
    /// run at once, in the task's order); the caller's thread, before and after, does not.
    #[test]
    fn a_device_thread_task_knows_it_is_one() {
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        let x = Tensor::<1>::ones([4], &device);
        let client = match super::cube_device(&x.device()) {
            Some(gpu) => gpu.client(),
            None => panic!("a wgpu device is CubeCL's"),
        };
        assert!(!super::inside_device_task());
        let inside = super::on_device_thread(&client, super::inside_device_task);
        assert_eq!(inside, Some(true));
        assert!(!super::inside_device_task());
    }
}
