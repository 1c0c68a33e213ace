//! [`crate::write_cache_rows`] on the GPU: one kernel writes a decoding step's keys and
//! values into both cache buffers (Burn's `slice_assign` is a launch each), one unit per element
//! written. Like `slice_assign`, it writes in place when a buffer's memory is not shared, and into
//! a copy otherwise. Plain tensors only: decoding is never differentiated.

use crate::GpuKernel;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{
    Autodiff, AutodiffBackend, Backend, Dispatch, TensorMetadata, backend_extension,
};
use burn::tensor::{DType, Int, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;

/// The cache buffers with `k` and `v` written at positions `start..start + T`, for plain `f32`
/// tensors on a CubeCL device; otherwise everything back.
///
/// # Shapes
/// - k_buffer, v_buffer: `[B, H, C, K]`
/// - k, v: `[B, H, T, K]` (any strides), `start + T <= C`
#[allow(clippy::type_complexity)]
pub(crate) fn write_cache_rows(
    k_buffer: Tensor<4>,
    v_buffer: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    start: usize,
) -> Result<(Tensor<4>, Tensor<4>), (Tensor<4>, Tensor<4>, Tensor<4>, Tensor<4>)> {
    if !takes([&k_buffer, &v_buffer, &k, &v], start) {
        return Err((k_buffer, v_buffer, k, v));
    }
    let (keys, values) = <Dispatch as CacheWriteKernels>::write_cache_rows(
        k_buffer.into_dispatch(),
        v_buffer.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        start,
    );
    Ok((Tensor::from_dispatch(keys), Tensor::from_dispatch(values)))
}

/// Whether the kernel takes buffers `[B, H, C, K]` and rows `[B, H, T, K]` written from `start`:
/// plain `f32` tensors on a CubeCL device, of matching shapes, `start + T <= C`.
fn takes([k_buffer, v_buffer, k, v]: [&Tensor<4>; 4], start: usize) -> bool {
    let [b, h, c, d] = k_buffer.dims();
    let [_, _, t, _] = k.dims();
    let fits = v_buffer.dims() == [b, h, c, d]
        && k.dims() == [b, h, t, d]
        && v.dims() == [b, h, t, d]
        && start + t <= c
        && t > 0
        && d > 0;
    fits && [k_buffer, v_buffer, k, v]
        .into_iter()
        .all(|x| super::gpu_kernel_takes_plain(GpuKernel::CacheWrite, x))
}

/// [`write_cache_rows`] at the position held by `position` `[1]` on the device.
#[allow(clippy::type_complexity)]
pub(crate) fn write_cache_rows_at(
    k_buffer: Tensor<4>,
    v_buffer: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    position: &Tensor<1, Int>,
) -> Result<(Tensor<4>, Tensor<4>), (Tensor<4>, Tensor<4>, Tensor<4>, Tensor<4>)> {
    // The position is on the device: only that the rows fit at all is checked here.
    if !takes([&k_buffer, &v_buffer, &k, &v], 0) {
        return Err((k_buffer, v_buffer, k, v));
    }
    let (keys, values) = <Dispatch as CacheWriteKernels>::write_cache_rows_at(
        k_buffer.into_dispatch(),
        v_buffer.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        position.clone().into_dispatch(),
    );
    Ok((Tensor::from_dispatch(keys), Tensor::from_dispatch(values)))
}

/// The cache write on every backend that has the kernel: CubeCL's, Burn's fusion over it, and
/// autodiff over either (which hands it the inner tensors: it is never differentiated).
#[backend_extension(Cube, Fusion: cfg(feature = "fusion"), Autodiff)]
pub trait CacheWriteKernels: Backend {
    /// `k_buffer`, `v_buffer` `[B, H, C, K]` with `k`, `v` `[B, H, T, K]` written at positions
    /// `start..start + T`.
    #[fusion(meta = |k_buffer, v_buffer, _k, _v, _start| (k_buffer.clone(), v_buffer.clone()))]
    fn write_cache_rows(
        k_buffer: FloatTensor<Self>,
        v_buffer: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        start: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// [`CacheWriteKernels::write_cache_rows`] at the position `position` `[1]` holds.
    #[fusion(meta = |k_buffer, v_buffer, _k, _v, _position| (k_buffer.clone(), v_buffer.clone()))]
    fn write_cache_rows_at(
        k_buffer: FloatTensor<Self>,
        v_buffer: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        position: IntTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

impl CacheWriteKernels for CubeBackend {
    fn write_cache_rows(
        k_buffer: CubeTensor,
        v_buffer: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        start: usize,
    ) -> (CubeTensor, CubeTensor) {
        assert_eq!(k.dtype(), DType::F32, "cache-write kernel: f32 only");
        let (k_buffer, v_buffer) = (owned(k_buffer), owned(v_buffer));
        let n = k.shape().num_elements();
        let (count, dim) = super::launch_size(&k, 2 * n);
        kernels::write_cache_rows::launch::<f32>(
            &k.client.clone(),
            count,
            dim,
            k_buffer.clone().into_tensor_arg(),
            v_buffer.clone().into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            start,
        );
        (k_buffer, v_buffer)
    }

    fn write_cache_rows_at(
        k_buffer: CubeTensor,
        v_buffer: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        position: CubeTensor,
    ) -> (CubeTensor, CubeTensor) {
        assert_eq!(k.dtype(), DType::F32, "cache-write kernel: f32 only");
        let (k_buffer, v_buffer) = (owned(k_buffer), owned(v_buffer));
        let position = super::ids_i32(position);
        let n = k.shape().num_elements();
        let (count, dim) = super::launch_size(&k, 2 * n);
        kernels::write_cache_rows_at::launch::<f32>(
            &k.client.clone(),
            count,
            dim,
            k_buffer.clone().into_tensor_arg(),
            v_buffer.clone().into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            position.into_tensor_arg(),
        );
        (k_buffer, v_buffer)
    }
}

/// `x` itself where nothing else holds its memory (the write is then in place, as Burn's
/// `slice_assign`), else a copy.
fn owned(x: CubeTensor) -> CubeTensor {
    match x.can_mut() && x.is_nonoverlapping() {
        true => x,
        false => x.copy(),
    }
}

impl<B: CacheWriteKernels, C: CheckpointStrategy> CacheWriteKernels for Autodiff<B, C> {
    // Never differentiated: the entry point takes plain tensors only.
    fn write_cache_rows(
        k_buffer: FloatTensor<Self>,
        v_buffer: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        start: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let [k_buffer, v_buffer, k, v] = [k_buffer, v_buffer, k, v].map(Self::inner);
        let (keys, values) = B::write_cache_rows(k_buffer, v_buffer, k, v, start);
        (Self::from_inner(keys), Self::from_inner(values))
    }

    fn write_cache_rows_at(
        k_buffer: FloatTensor<Self>,
        v_buffer: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        position: IntTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let [k_buffer, v_buffer, k, v] = [k_buffer, v_buffer, k, v].map(Self::inner);
        let (keys, values) = B::write_cache_rows_at(k_buffer, v_buffer, k, v, position);
        (Self::from_inner(keys), Self::from_inner(values))
    }
}

mod kernels {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    /// The index of element `[b, h, p, c]` of `t`, by its strides.
    #[cube]
    fn at<F: Float>(t: &Tensor<F>, b: usize, h: usize, p: usize, c: usize) -> usize {
        b * t.stride(0) + h * t.stride(1) + p * t.stride(2) + c * t.stride(3)
    }

    /// [`write_rows`] at `start`.
    #[cube(launch)]
    pub(super) fn write_cache_rows<F: Float>(
        k_buffer: &mut Tensor<F>,
        v_buffer: &mut Tensor<F>,
        k: &Tensor<F>,
        v: &Tensor<F>,
        start: usize,
    ) {
        write_rows::<F>(k_buffer, v_buffer, k, v, start);
    }

    /// [`write_rows`] at the position `position[0]` (read on the device: a captured step
    /// writes wherever the position buffer says when it is replayed).
    #[cube(launch)]
    pub(super) fn write_cache_rows_at<F: Float>(
        k_buffer: &mut Tensor<F>,
        v_buffer: &mut Tensor<F>,
        k: &Tensor<F>,
        v: &Tensor<F>,
        position: &Tensor<i32>,
    ) {
        write_rows::<F>(k_buffer, v_buffer, k, v, position[0] as usize);
    }

    /// Unit `i < n` (`n` the elements of `k`) writes element `i` of `k`, unit `n + i` element
    /// `i` of `v`, each at its row's position plus `start` in its buffer.
    #[cube]
    fn write_rows<F: Float>(
        k_buffer: &mut Tensor<F>,
        v_buffer: &mut Tensor<F>,
        k: &Tensor<F>,
        v: &Tensor<F>,
        start: usize,
    ) {
        let (heads, t, d) = (k.shape(1), k.shape(2), k.shape(3));
        let n = k.shape(0) * heads * t * d;
        let i = ABSOLUTE_POS;
        if i >= 2 * n {
            terminate!();
        }
        let j = i % n;
        let c = j % d;
        let row = (j / d) % t;
        let h = (j / d / t) % heads;
        let b = j / d / t / heads;
        if i < n {
            let to = at(&*k_buffer, b, h, start + row, c);
            k_buffer[to] = k[at(k, b, h, row, c)];
        } else {
            let to = at(&*v_buffer, b, h, start + row, c);
            v_buffer[to] = v[at(v, b, h, row, c)];
        }
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use burn::tensor::{DeviceKind, Distribution};

    /// Against two `slice_assign`s: keys and values that are views with their heads swapped in
    /// (as the model passes them), one row and several, at the first, a middle and the last
    /// positions; a buffer also held elsewhere keeps its old contents (the write goes to a copy).
    #[test]
    fn cache_write_equals_slice_assign_on_wgpu() {
        let device = burn::tensor::Device::wgpu(DeviceKind::DefaultDevice);
        let normal = Distribution::Normal(0.0, 1.0);
        for (b, heads, cap, d, start, t) in [
            (1, 2, 8, 4, 0, 1),
            (2, 3, 16, 5, 7, 1),
            (2, 2, 16, 8, 10, 6),
            (1, 1, 9, 3, 8, 1),
        ] {
            let buffer = || Tensor::<4>::random([b, heads, cap, d], normal, &device);
            let (kb, vb) = (buffer(), buffer());
            let rows = || Tensor::<4>::random([b, t, heads, d], normal, &device).swap_dims(1, 2);
            let (k, v) = (rows(), rows());
            let (want_k, want_v) = crate::write_cache_rows_reference(
                kb.clone(),
                vb.clone(),
                k.clone(),
                v.clone(),
                start,
            );
            let kept = kb.to_data();
            // The position read from a device tensor (a replayed step) writes the same rows.
            let position = Tensor::<1, Int>::from_ints([start as i32], &device);
            let (at_k, at_v) =
                write_cache_rows_at(kb.clone(), vb.clone(), k.clone(), v.clone(), &position)
                    .unwrap_or_else(|_| panic!("plain wgpu f32 tensors"));
            let (got_k, got_v) = write_cache_rows(kb.clone(), vb, k, v, start)
                .unwrap_or_else(|_| panic!("plain wgpu f32 tensors"));
            got_k
                .into_data()
                .assert_eq(&want_k.clone().into_data(), true);
            got_v
                .into_data()
                .assert_eq(&want_v.clone().into_data(), true);
            at_k.into_data().assert_eq(&want_k.into_data(), true);
            at_v.into_data().assert_eq(&want_v.into_data(), true);
            kb.into_data().assert_eq(&kept, true);
        }
        // Tracked tensors go back to the caller (decoding is never differentiated).
        let tracked = device.clone().autodiff();
        let x = Tensor::<4>::random([1, 1, 4, 2], normal, &tracked);
        let row = Tensor::<4>::random([1, 1, 1, 2], normal, &tracked);
        assert!(write_cache_rows(x.clone(), x, row.clone(), row, 0).is_err());
    }
}
