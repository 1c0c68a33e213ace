//! [`crate::write_token`] and [`crate::write_in_place`] on the GPU: the device buffers
//! a captured decoding step reads (see `ops/step_inputs`). The token is written by one unit,
//! which reads the position where it is (a read back to the host would wait for the device and
//! could not be recorded in a graph); the host's writes go straight into the buffer's memory.

use burn::backend::tensor::IntTensor;
use burn::backend::{Backend, BackendTensor, Dispatch, DispatchTensorKind, backend_extension};
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_cubecl::CubeBackend;
use burn_cubecl::cubecl::{CubeCount, CubeDim};
use burn_cubecl::tensor::CubeTensor;

/// [`crate::write_token`] for int tensors on a CubeCL device (without fusion); the
/// tensors back otherwise.
#[allow(clippy::type_complexity)]
pub(crate) fn write_token(
    history: Tensor<1, Int>,
    position: &Tensor<1, Int>,
    offset: usize,
    token: Tensor<2, Int>,
) -> Result<Tensor<1, Int>, (Tensor<1, Int>, Tensor<2, Int>)> {
    let on_cube = |x: &Tensor<1, Int>| {
        matches!(
            &x.clone().into_dispatch().kind,
            DispatchTensorKind::Cube(BackendTensor::Int(_))
        )
    };
    // Decoding with Burn's fusion keeps to the reference.
    if cfg!(feature = "fusion")
        || !(on_cube(&history) && on_cube(position) && token.dims() == [1, 1])
    {
        return Err((history, token));
    }
    let history = <Dispatch as StepInputKernels>::write_token(
        history.into_dispatch(),
        position.clone().into_dispatch(),
        token.reshape([1]).into_dispatch(),
        offset,
    );
    Ok(Tensor::from_dispatch(history))
}

/// [`crate::write_in_place`] on a CubeCL device: `data` copied into the memory of `tensor`
/// when it is a plain contiguous tensor of `data`'s dtype and length.
pub(crate) fn write_in_place<const D: usize, K: burn::tensor::kind::Basic>(
    tensor: &Tensor<D, K>,
    data: TensorData,
) -> bool {
    // Burn's fusion owns its buffers (a tensor may not have one yet): nothing is written.
    #[cfg(feature = "fusion")]
    {
        let _ = (tensor, data);
        false
    }
    #[cfg(not(feature = "fusion"))]
    {
        let dispatch = tensor.clone().into_dispatch();
        let cube = match &dispatch.kind {
            DispatchTensorKind::Cube(
                BackendTensor::Float(t) | BackendTensor::Int(t) | BackendTensor::Bool(t),
            ) => t,
            #[allow(unreachable_patterns)]
            _ => return false,
        };
        // A tensor's handle starts where the tensor does (a slice's handle is offset), and may
        // be longer (allocations are padded).
        let fits = cube.dtype == data.dtype()
            && cube.meta.shape().num_elements() == data.num_elements()
            && cube.is_contiguous()
            && data.as_bytes().len() as u64 <= cube.handle.size();
        if fits {
            cube.client.write(&cube.handle, data.into_bytes());
        }
        fits
    }
}

/// The token write on CubeCL's backend (decoding only: no autodiff; with Burn's fusion the entry
/// point keeps to the reference, the deferred version is there for the dispatch).
#[backend_extension(Cube, Fusion: cfg(feature = "fusion"))]
pub trait StepInputKernels: Backend {
    /// `history` `[N]` with `token` `[1]` written at `position[0] + offset`.
    #[fusion(meta = history_spec)]
    fn write_token(
        history: IntTensor<Self>,
        position: IntTensor<Self>,
        token: IntTensor<Self>,
        offset: usize,
    ) -> IntTensor<Self>;
}

/// The written history: the same length, as `i32`.
#[cfg(feature = "fusion")]
fn history_spec(
    history: &burn::backend::fusion::custom::TensorSpec,
    _position: &burn::backend::fusion::custom::TensorSpec,
    _token: &burn::backend::fusion::custom::TensorSpec,
    _offset: &usize,
) -> burn::backend::fusion::custom::TensorSpec {
    burn::backend::fusion::custom::TensorSpec::new(history.shape.clone(), DType::I32)
}

impl StepInputKernels for CubeBackend {
    fn write_token(
        history: CubeTensor,
        position: CubeTensor,
        token: CubeTensor,
        offset: usize,
    ) -> CubeTensor {
        // The history is read as `i32`, in place where nothing else holds it (a captured step
        // writes the same buffer at every replay).
        let history = match history.dtype == DType::I32 && history.can_mut() {
            true => burn_cubecl::kernel::into_contiguous(history),
            false => super::ids_i32(history).copy(),
        };
        let position = super::ids_i32(position);
        let token = super::ids_i32(token);
        kernels::write_token::launch(
            &history.client.clone(),
            CubeCount::new_single(),
            CubeDim::new_single(),
            history.clone().into_tensor_arg(),
            position.into_tensor_arg(),
            token.into_tensor_arg(),
            offset,
        );
        history
    }
}

mod kernels {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    /// `history[position[0] + offset] = token[0]`.
    #[cube(launch)]
    pub(super) fn write_token(
        history: &mut Tensor<i32>,
        position: &Tensor<i32>,
        token: &Tensor<i32>,
        offset: usize,
    ) {
        history[position[0] as usize + offset] = token[0];
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use burn::tensor::DeviceKind;

    fn ints(t: Tensor<1, Int>) -> Vec<i64> {
        t.into_data()
            .convert::<i64>()
            .try_into_vec::<i64>()
            .unwrap()
    }

    /// The token written at the position the device holds plus the offset, as the reference
    /// writes it; a history also held elsewhere is copied, not written.
    #[test]
    fn token_writes_equal_the_reference_on_wgpu() {
        let device = burn::tensor::Device::wgpu(DeviceKind::DefaultDevice);
        let history = || Tensor::<1, Int>::from_ints([3, 1, 4, 1, 5, 9, 2], &device);
        for (position, offset, token) in [(0, 0, 7), (2, 1, 8), (5, 1, 6), (6, 0, 11)] {
            let at = Tensor::<1, Int>::from_ints([position], &device);
            let token = || Tensor::<1, Int>::from_ints([token], &device).reshape([1, 1]);
            let want = ints(crate::write_token_reference(
                history(),
                &at,
                offset,
                token(),
            ));
            let shared = history();
            let kept = ints(shared.clone());
            let got = write_token(shared.clone(), &at, offset, token())
                .unwrap_or_else(|_| panic!("wgpu int tensors"));
            assert_eq!(ints(got), want, "{position} + {offset}");
            assert_eq!(ints(shared), kept, "a shared history is copied");
        }
        // Writes in turn into a history nothing else holds (a replayed step's) accumulate.
        let own = crate::write_token(
            history(),
            &Tensor::from_ints([0], &device),
            0,
            Tensor::from_ints([[42]], &device),
        );
        let again = crate::write_token(
            own,
            &Tensor::from_ints([1], &device),
            0,
            Tensor::from_ints([[43]], &device),
        );
        assert_eq!(ints(again)[..3], [42, 43, 4]);
    }

    /// The host's write lands in the tensor's own memory, so every clone reads it; a dtype or
    /// length other than the data's, or a view that is not contiguous, is refused untouched.
    #[test]
    fn in_place_writes_reach_every_clone_on_wgpu() {
        let device = burn::tensor::Device::wgpu(DeviceKind::DefaultDevice);
        let position = Tensor::<1, Int>::from_data(TensorData::new(vec![0i32], [1]), &device);
        let clone = position.clone();
        assert!(crate::write_in_place(
            &position,
            TensorData::new(vec![17i32], [1])
        ));
        assert_eq!(ints(clone.clone()), [17]);
        assert!(!crate::write_in_place(
            &position,
            TensorData::new(vec![1.5f32], [1])
        ));
        assert!(!crate::write_in_place(
            &position,
            TensorData::new(vec![1i32, 2], [2])
        ));
        assert_eq!(ints(clone), [17]);
        let u = Tensor::<1>::from_floats([0.0], &device);
        assert!(crate::write_in_place(
            &u,
            TensorData::new(vec![0.25f32], [1])
        ));
        assert_eq!(u.into_scalar::<f32>(), 0.25);
        let columns = Tensor::<2>::from_floats([[1.0, 2.0], [3.0, 4.0]], &device).swap_dims(0, 1);
        assert!(!crate::write_in_place(
            &columns,
            TensorData::new(vec![0f32; 4], [2, 2])
        ));
        // Flex tensors are not written in place.
        let flex = Tensor::<1>::from_floats([0.0], &burn::tensor::Device::flex());
        assert!(!crate::write_in_place(
            &flex,
            TensorData::new(vec![1f32], [1])
        ));
    }
}
