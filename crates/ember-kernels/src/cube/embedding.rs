//! The gradient of an embedding table on the GPU, for small vocabularies (a character model's):
//! the rows of the gradient split into chunks, each chunk's sums per id kept in shared memory.
//!
//! Burn 0.22.1 differentiates a lookup with `select_assign` into a zeroed table, whose kernel
//! gives each of the table's `D` columns one unit, and each unit walks all `N` ids one after
//! another: `D` units for the whole GPU (384 for nanoGPT's GPU config, whose token table's
//! gradient took 2.6 ms a step on an H100). Here a cube takes [`COLUMNS`] columns of
//! [`CHUNK`] rows of the gradient; each unit adds its column of each row into that row's id's
//! slot of shared memory (a unit owns its column's slots: no synchronisation) and writes the
//! chunk's `[V]` sums; a reduction over the chunks gives the table's gradient. `N * D` additions
//! as Burn's, spread over `N / CHUNK * D` units. The slots take `V * COLUMNS` floats of shared
//! memory, so vocabularies up to [`MAX_VOCAB`]; larger ones keep Burn's. The forward lookup is
//! Burn's `select` either way.

use crate::GpuKernel;
use crate::cube::autodiff::tracked;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, unary};
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{
    Autodiff, AutodiffBackend, Backend, Dispatch, TensorMetadata, backend_extension,
};
use burn::tensor::{DType, FloatDType, Int, Shape, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::cubecl::{CubeCount, CubeDim};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

/// The largest vocabulary the kernel takes: its sums per id and column, [`COLUMNS`] floats
/// each, fit 12 KiB of shared memory (Vulkan guarantees 16).
pub(crate) const MAX_VOCAB: usize = 96;

/// Units of a cube, one per column: a warp reads a row's 32 neighbouring values at once.
const COLUMNS: usize = 32;

/// Gradient rows per cube.
const CHUNK: usize = 256;

/// The rows of `table` picked by `ids`, where `table` is an `f32` tensor on a CubeCL device
/// tracked by autodiff (training: the gradient is what the kernel is for) and `V` is at most
/// [`MAX_VOCAB`]; `ids` back otherwise.
///
/// # Shapes
/// - table: `[V, D]`
/// - ids: `[B, T]`, every id below `V`
/// - output: `[B, T, D]`
pub(crate) fn embed(table: Tensor<2>, ids: Tensor<2, Int>) -> Result<Tensor<3>, Tensor<2, Int>> {
    let [v, d] = table.dims();
    let [b, t] = ids.dims();
    let n = b * t;
    let fits = table.device().is_autodiff() && n > 0 && d > 0 && v <= MAX_VOCAB;
    // A narrow table (mixed precision's bf16 view of the weights) is widened first where the
    // kernel takes the widened one: `[V, D]` values, few for the vocabularies it takes. The
    // rows are the same (the reference widens them after the lookup), and the gradient comes
    // back through the kernel, summed in f32, and the cast; otherwise it is Burn's
    // `select_assign` on the narrow table (2.3 ms of a bf16 step of nanoGPT's GPU config on an
    // H200, in one launch).
    let narrow = fits
        && table.dtype() != DType::F32
        && crate::gpu_kernels::uses(GpuKernel::Embedding)
        && crate::on_cubecl(&table.device());
    let table = match narrow {
        true => table.cast(FloatDType::F32),
        false => table,
    };
    if !(fits && super::gpu_kernel_takes(GpuKernel::Embedding, &table)) {
        return Err(ids);
    }
    let rows = <Dispatch as EmbeddingKernels>::embedding_rows(
        table.into_dispatch(),
        ids.reshape([n]).into_dispatch(),
    );
    Ok(Tensor::<2>::from_dispatch(rows).reshape([b, t, d]))
}

/// The lookup on every backend that has the kernel: CubeCL's, Burn's fusion over it, and
/// autodiff over either.
#[backend_extension(Cube, Fusion: cfg(feature = "fusion"), Autodiff)]
pub trait EmbeddingKernels: Backend {
    /// Rows `ids` `[N]` of `table` `[V, D]`: `[N, D]`.
    #[fusion(meta = rows_spec)]
    fn embedding_rows(table: FloatTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self>;

    /// The table's gradient `[V, D]` from the rows' `grad` `[N, D]`: row `v` is the sum of the
    /// rows of `grad` whose id is `v`.
    #[fusion(meta = table_spec)]
    fn embedding_rows_backward(
        ids: IntTensor<Self>,
        grad: FloatTensor<Self>,
        vocab: usize,
    ) -> FloatTensor<Self>;
}

#[cfg(feature = "fusion")]
use burn::backend::fusion::custom::TensorSpec;

/// The lookup's output: a row per id.
#[cfg(feature = "fusion")]
fn rows_spec(table: &TensorSpec, ids: &TensorSpec) -> TensorSpec {
    use burn::tensor::Shape;
    let [_, d] = table.shape.dims::<2>();
    let [n] = ids.shape.dims::<1>();
    TensorSpec::new(Shape::new([n, d]), table.dtype)
}

/// The table's gradient: `vocab` rows as wide as the rows' gradient.
#[cfg(feature = "fusion")]
fn table_spec(_ids: &TensorSpec, grad: &TensorSpec, vocab: &usize) -> TensorSpec {
    use burn::tensor::Shape;
    let [_, d] = grad.shape.dims::<2>();
    TensorSpec::new(Shape::new([*vocab, d]), grad.dtype)
}

impl EmbeddingKernels for CubeBackend {
    fn embedding_rows(table: CubeTensor, ids: CubeTensor) -> CubeTensor {
        CubeBackend::float_select(table, 0, ids)
    }

    fn embedding_rows_backward(ids: CubeTensor, grad: CubeTensor, vocab: usize) -> CubeTensor {
        let (ids, grad) = (super::ids_i32(ids), into_contiguous(grad));
        assert_eq!(grad.dtype(), DType::F32, "embedding kernel: f32 only");
        let [n, d] = grad.shape().dims::<2>();
        let chunks = n.div_ceil(CHUNK);
        let partial = super::empty(&grad, [chunks, vocab * d]);
        kernels::embedding_backward::launch::<f32>(
            &grad.client.clone(),
            CubeCount::new_2d(d.div_ceil(COLUMNS) as u32, chunks as u32),
            CubeDim::new_1d(COLUMNS as u32),
            ids.into_tensor_arg(),
            grad.into_tensor_arg(),
            partial.clone().into_tensor_arg(),
            vocab,
            COLUMNS,
            CHUNK,
        );
        // The chunks' sums added by the backend's reduction.
        let table = match chunks {
            1 => partial,
            _ => CubeBackend::float_sum_dim(partial, 0),
        };
        CubeBackend::float_reshape(table, Shape::new([vocab, d]))
    }
}

impl<B: EmbeddingKernels, C: CheckpointStrategy> EmbeddingKernels for Autodiff<B, C> {
    fn embedding_rows(table: FloatTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self> {
        let vocab = table.shape().dims::<2>()[0];
        tracked::<B, C, _, _>(Lookup(vocab), [table], |[table]| {
            (B::embedding_rows(table, ids.clone()), ids)
        })
    }

    // Not differentiated on its own: only the lookup is.
    fn embedding_rows_backward(
        ids: IntTensor<Self>,
        grad: FloatTensor<Self>,
        vocab: usize,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::embedding_rows_backward(ids, Self::inner(grad), vocab))
    }
}

/// The autodiff node of the lookup: the table's row count.
#[derive(Debug)]
struct Lookup(usize);

impl<B: EmbeddingKernels> Backward<B, 1> for Lookup {
    /// The ids.
    type State = IntTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let ids = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::embedding_rows_backward(ids, grad, self.0)
        });
    }
}

mod kernels {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    /// Cube `(x, c)`, unit `u`: column `j = x * columns + u` of gradient rows
    /// `c * chunk ..` (`chunk` of them, fewer in the last cube), summed per id into
    /// `partial[c, id * D + j]`. Ids at or past `vocab` are skipped.
    #[cube(launch)]
    pub(super) fn embedding_backward<F: Float>(
        ids: &Tensor<i32>,
        grad: &Tensor<F>,
        partial: &mut Tensor<F>,
        #[comptime] vocab: usize,
        #[comptime] columns: usize,
        #[comptime] chunk: usize,
    ) {
        let d = grad.shape(1);
        let u = UNIT_POS_X as usize;
        let j = CUBE_POS_X as usize * columns + u;
        if j >= d {
            terminate!();
        }
        // Unit `u` owns slots `id * columns + u`: no other unit reads or writes them.
        let mut sums = Shared::<[F]>::new_slice(vocab * columns);
        for v in 0..vocab {
            sums[v * columns + u] = F::new(0.0);
        }
        let c = CUBE_POS_Y as usize;
        let mut end = c * chunk + chunk;
        if end > ids.len() {
            end = ids.len();
        }
        for i in c * chunk..end {
            let id = usize::cast_from(ids[i]);
            if id < vocab {
                sums[id * columns + u] += grad[i * d + j];
            }
        }
        let at = c * vocab * d;
        for v in 0..vocab {
            partial[at + v * d + j] = sums[v * columns + u];
        }
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use burn::nn::EmbeddingConfig;
    use burn::tensor::{Device, DeviceKind, Distribution, Int, Tensor};

    use crate::{embed, embed_reference};

    /// The looked-up rows and the table's gradient against Burn's `Embedding` on wgpu, with
    /// repeated ids and rows no id picks, widths above and below a cube's columns, one chunk of
    /// rows and several (555 ids), the largest vocabulary taken, under autodiff and with
    /// checkpointing; and the sums by hand for one column.
    #[test]
    fn lookup_and_table_gradient_equal_burns_on_wgpu() {
        let base = Device::wgpu(DeviceKind::DefaultDevice);
        for device in [
            base.clone().autodiff(),
            base.autodiff().gradient_checkpointing(),
        ] {
            for (v, d, b, t) in [
                (5, 3, 1, 7),
                (65, 130, 3, 11),
                (17, 384, 2, 64),
                (96, 70, 5, 111),
            ] {
                let table = EmbeddingConfig::new(v, d).init(&device);
                // Ids below `v - 1`: the last row is never picked, so its gradient is 0.
                let ids: Vec<i64> = (0..b * t)
                    .map(|i| ((i * i + 3 * i) % (v - 1)) as i64)
                    .collect();
                let ids = Tensor::<1, Int>::from_ints(ids.as_slice(), &device).reshape([b, t]);
                let g = Tensor::<3>::random([b, t, d], Distribution::Normal(0.0, 1.0), &device);
                let run = |ours: bool| {
                    let rows = match ours {
                        true => embed(&table, ids.clone()),
                        false => embed_reference(&table, ids.clone()),
                    };
                    let grads = (rows.clone() * g.clone()).sum().backward();
                    (rows.inner(), table.weight.val().grad(&grads).unwrap())
                };
                let ((rows, grad), (want_rows, want_grad)) = (run(true), run(false));
                rows.into_data().assert_eq(&want_rows.into_data(), true);
                let diff = (grad.clone() - want_grad).abs().max().into_scalar::<f32>();
                assert!(
                    diff < 1e-5,
                    "[{v}, {d}], {b}x{t} ids: gradient off by {diff}"
                );
                let last = grad
                    .clone()
                    .narrow(0, v - 1, 1)
                    .abs()
                    .sum()
                    .into_scalar::<f32>();
                assert_eq!(last, 0.0, "a row no id picked");
                // Column 0 of row `ids[0]`, by hand.
                let flat: Vec<i64> = ids.to_data().convert::<i64>().try_to_vec().unwrap();
                let gs: Vec<f32> = g.to_data().try_to_vec().unwrap();
                let want: f32 = (0..b * t)
                    .filter(|&i| flat[i] == flat[0])
                    .map(|i| gs[i * d])
                    .sum();
                let row = flat[0] as usize;
                let got = grad.slice([row..row + 1, 0..1]).into_scalar::<f32>();
                assert!((got - want).abs() < 1e-4, "by hand: {got} vs {want}");
            }
        }
    }

    /// A narrow table, as mixed precision's view casts it (here f16, which lavapipe has; bf16
    /// on CUDA takes the same path): the kernel takes the widened table, the rows equal Burn's
    /// lookup widened, and the f32 master weight's gradient equals the f32 sums of the output
    /// gradient rounded once to the narrow type (Burn's sums in the narrow type would round at
    /// every addition).
    #[test]
    fn a_narrow_table_takes_the_kernel_on_wgpu() {
        use burn::tensor::FloatDType;
        let device = Device::wgpu(DeviceKind::DefaultDevice).autodiff();
        let (v, d, b, t) = (65, 40, 3, 50);
        let master = EmbeddingConfig::new(v, d).init(&device);
        // Mixed precision's view (ember_model::precision::products_in): the weight cast in
        // the graph, its parameter id kept, so the master weight gets the gradient.
        let mut table = master.clone();
        table.weight = table.weight.map(|w| w.cast(FloatDType::F16));
        assert_eq!(table.weight.val().dtype(), burn::tensor::DType::F16);
        let ids: Vec<i64> = (0..b * t).map(|i| ((i * 7 + 1) % v) as i64).collect();
        let ids = Tensor::<1, Int>::from_ints(ids.as_slice(), &device).reshape([b, t]);
        let g = Tensor::<3>::random([b, t, d], Distribution::Normal(0.0, 1.0), &device);
        assert!(
            super::embed(table.weight.val(), ids.clone()).is_ok(),
            "the kernel takes it"
        );
        let rows = embed(&table, ids.clone());
        assert_eq!(rows.dtype(), burn::tensor::DType::F32);
        let want_rows = embed_reference(&table, ids.clone());
        rows.clone()
            .inner()
            .into_data()
            .assert_eq(&want_rows.inner().into_data(), true);
        let grads = (rows * g.clone()).sum().backward();
        let grad = master.weight.val().grad(&grads).unwrap();
        assert_eq!(grad.dtype(), burn::tensor::DType::F32);
        // The same sums from an f32 table through the kernel, rounded to f16 once.
        let grads = (embed(&master, ids) * g).sum().backward();
        let want = master
            .weight
            .val()
            .grad(&grads)
            .unwrap()
            .cast(FloatDType::F16)
            .cast(FloatDType::F32);
        grad.into_data().assert_eq(&want.into_data(), true);
    }
}
