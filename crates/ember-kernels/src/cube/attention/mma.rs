//! The training attention on tensor cores ([`GpuStrategy::AttentionMma`]): which fragment
//! shape and operand type a device offers for a projection's type, the blocks that fit its
//! shared memory, and the three kernels' launches.
//!
//! The operand type follows the projection: TF32 for `f32` (the type cuBLAS's `f32` products
//! already run in on CUDA), its own type for bf16 and f16. A device without fragments of that
//! type (a Vulkan GPU has no TF32; lavapipe offers 8x8x8 f16) leaves the pass to the fused
//! kernels, so an `f32` model never runs its attention in f16.

use super::dims::Dims;
use super::kernels;
use crate::GpuStrategy;
use burn::backend::TensorMetadata;
use burn::tensor::{DType, bf16, f16};
use burn_cubecl::cubecl::ir::{DeviceProperties, ElemType, FloatKind};
use burn_cubecl::cubecl::tf32;
use burn_cubecl::cubecl::{CubeCount, CubeDim};
use burn_cubecl::tensor::CubeTensor;

/// The type the products read their operands in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Operand {
    Tf32,
    F16,
    Bf16,
}

impl Operand {
    /// The operand type for a projection of type `dtype`.
    pub(crate) fn for_projection(dtype: DType) -> Option<Operand> {
        match dtype {
            DType::F32 => Some(Operand::Tf32),
            DType::F16 => Some(Operand::F16),
            DType::BF16 => Some(Operand::Bf16),
            _ => None,
        }
    }

    /// The projection type this operand type follows (the inverse of
    /// [`Operand::for_projection`]).
    fn projection(self) -> DType {
        match self {
            Operand::Tf32 => DType::F32,
            Operand::F16 => DType::F16,
            Operand::Bf16 => DType::BF16,
        }
    }

    fn elem(self) -> ElemType {
        ElemType::Float(match self {
            Operand::Tf32 => FloatKind::TF32,
            Operand::F16 => FloatKind::F16,
            Operand::Bf16 => FloatKind::BF16,
        })
    }

    /// Panics unless `x` is of the projection type this operand type follows (what the kernels
    /// read and write their tensors in).
    fn check_projection(self, x: &CubeTensor) {
        assert_eq!(
            x.dtype(),
            self.projection(),
            "tensor-core attention in {self:?} reads and writes {:?}",
            x.dtype()
        );
    }

    /// Bytes of one operand in shared memory (TF32 is stored as `f32`).
    fn bytes(self) -> usize {
        match self {
            Operand::Tf32 => 4,
            Operand::F16 | Operand::Bf16 => 2,
        }
    }
}

/// How one call runs: the operand type, the fragments' shape `(m, n, k)`, the units of a
/// plane, the planes that compute products (a block is `planes * m` rows), the rows of each
/// tile the block streams (`cols`) and the units per row in the row-wise steps (`parts`; a
/// cube has `rows * parts` units, the planes past `planes` only help there).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct MmaPlan {
    pub(crate) operand: Operand,
    pub(crate) shape: (usize, usize, usize),
    pub(crate) plane: usize,
    pub(crate) planes: usize,
    pub(crate) cols: usize,
    pub(crate) parts: usize,
}

impl MmaPlan {
    /// The plans for heads of `head` in `operand` on a device with properties `props`: the
    /// largest square fragments of that operand type accumulating in `f32` whose sides divide
    /// the head size, and the largest blocks and tiles (64, 32, 16 or 8 rows) whose kernels fit
    /// half the device's shared memory (else all of it: ember's rule, first), then the largest
    /// that fit all of it where they differ (for `attention-tune` to time); none where there
    /// are no such fragments, a head size they do not divide, or planes of more than one size.
    pub(crate) fn all_for_device(
        props: &DeviceProperties,
        head: usize,
        operand: Operand,
    ) -> Vec<MmaPlan> {
        let hardware = &props.hardware;
        let plane = hardware.plane_size_max as usize;
        if plane == 0 || hardware.plane_size_min != hardware.plane_size_max {
            return Vec::new();
        }
        let f32_ = ElemType::Float(FloatKind::F32);
        let fragment = props
            .features
            .matmul
            .cmma
            .iter()
            .filter(|c| c.a_type == operand.elem() && c.b_type == operand.elem())
            .filter(|c| c.cd_type == f32_ && c.m == c.n)
            .map(|c| (c.m as usize, c.n as usize, c.k as usize))
            .filter(|&(m, n, k)| {
                plane.is_multiple_of(m) && head.is_multiple_of(n) && head.is_multiple_of(k)
            })
            .max_by_key(|&(m, _, _)| m);
        let Some(fragment @ (m, _, _)) = fragment else {
            return Vec::new();
        };
        let parts = crate::gpu_kernels::policy()
            .attention
            .mma_row_units
            .unwrap_or(plane / m)
            .max(1);
        if !head.is_multiple_of(parts) {
            return Vec::new();
        }
        let max_units = hardware.max_units_per_cube as usize;
        let plans = [(4, 4), (4, 2), (2, 2), (2, 1), (1, 1)].map(|(planes, tiles)| MmaPlan {
            operand,
            shape: fragment,
            plane,
            planes,
            cols: tiles * m,
            parts,
        });
        let fits = |plan: &MmaPlan, bytes: usize| {
            let units = plan.rows() * parts;
            units <= max_units
                && units.is_multiple_of(plane)
                && units >= plan.planes * plane
                && plan.cols <= units
                && plan.cols.is_multiple_of(parts)
                && plan.cols.is_multiple_of(fragment.2)
                && plan.shared_bytes(head) <= bytes
        };
        // Two cubes to a multiprocessor where half the shared memory holds one (a cube waits
        // at each of a tile's seven barriers; the other cube's work fills the wait), else one;
        // and the largest plan that fits all of it (one cube, larger tiles), where it differs,
        // for timing against the first (`attention-tune`).
        let max = hardware.max_shared_memory_size;
        let half = plans.into_iter().find(|plan| fits(plan, max / 2));
        let whole = plans.into_iter().find(|plan| fits(plan, max));
        match (half, whole) {
            (Some(half), Some(whole)) if half != whole => vec![half, whole],
            (Some(one), _) | (None, Some(one)) => vec![one],
            (None, None) => Vec::new(),
        }
    }

    /// The plans where the tensor cores apply to this call, ember's rule's first
    /// ([`MmaPlan::all_for_device`]): the strategy on, plans for the projection's type (`dtype`,
    /// before any widening), and the kernels found to agree with the fused kernels on the device
    /// ([`agrees_on`]).
    pub(super) fn all_that_apply(dims: &Dims, like: &CubeTensor, dtype: DType) -> Vec<MmaPlan> {
        if !crate::gpu_kernels::applies(GpuStrategy::AttentionMma) {
            return Vec::new();
        }
        let Some(operand) = Operand::for_projection(dtype) else {
            return Vec::new();
        };
        let plans = MmaPlan::all_for_device(like.client.properties(), dims.k(), operand);
        if plans.is_empty() || !agrees_on(like, operand, dims.k()) {
            return Vec::new();
        }
        plans
    }

    /// Rows of a cube's block.
    pub(crate) fn rows(&self) -> usize {
        self.planes * self.shape.0
    }

    /// The most shared memory any of the three kernels declares, for head size `k` (with up
    /// to 32 bytes of alignment before each of its ten arrays of fragments).
    pub(crate) fn shared_bytes(&self, k: usize) -> usize {
        let (rows, cols, e) = (self.rows(), self.cols, self.operand.bytes());
        let f = size_of::<f32>();
        let forward = (rows * k + 2 * cols * k + rows * cols) * e
            + (rows * cols + rows * k + rows * self.parts) * f;
        let queries = (2 * rows * k + 2 * cols * k + rows * cols) * e
            + (2 * rows * cols + rows * k + rows * self.parts + 2 * rows) * f;
        let keys = (2 * rows * k + 2 * cols * k + 2 * rows * cols) * e
            + (2 * rows * cols + 2 * rows * k + 2 * cols) * f;
        forward.max(queries).max(keys) + 10 * 32
    }

    fn launch_size(&self, dims: &Dims) -> (CubeCount, CubeDim) {
        (
            CubeCount::new_2d(
                dims.t.div_ceil(self.rows()) as u32,
                (dims.b * dims.heads) as u32,
            ),
            CubeDim::new_1d((self.rows() * self.parts) as u32),
        )
    }
}

/// Whether the tensor-core kernels agree with the fused kernels on `like`'s device
/// ([`mma_agrees`]) for heads of `head`, checked on the first call for each operand type and
/// head size in the process (a few small launches under the plans such calls take), so that
/// kernels never run on a GPU before cannot train a model wrongly: where they disagree, one
/// warning line, and the fused kernels run. While a graph is being recorded (where the check
/// could not allocate) a case not yet checked takes the fused kernels.
fn agrees_on(like: &CubeTensor, operand: Operand, head: usize) -> bool {
    use std::collections::HashMap;
    use std::sync::Mutex;
    static AGREES: Mutex<Option<HashMap<(Operand, usize), bool>>> = Mutex::new(None);
    let mut agrees = AGREES.lock().unwrap_or_else(|e| e.into_inner());
    let agrees = agrees.get_or_insert_with(HashMap::new);
    if let Some(&known) = agrees.get(&(operand, head)) {
        return known;
    }
    if like.client.is_capturing() {
        return false;
    }
    let known = match mma_agrees(like, operand, head) {
        Ok(()) => true,
        Err(why) => {
            eprintln!(
                "warning: ember's tensor-core attention disagrees with its fused kernels on this \
                 device ({why}); the attention runs on the fused kernels"
            );
            false
        }
    };
    agrees.insert((operand, head), known);
    known
}

/// The tensor-core kernels in `operand` against the fused kernels on `like`'s device, in the
/// projection type `operand` follows, for heads of `head`
/// ([`super::route::agrees_with_fused`]: output, log-sum-exps and gradient of 3 sequences of
/// 100 positions (two blocks of 64 rows, the second cut short) with dropout, inputs in
/// `-2..2`, within 1% of the largest value in `f32`, 2% in bf16 or f16), under each plan the
/// device has for such heads ([`MmaPlan::all_for_device`]: ember's rule's blocks and tiles and
/// the largest, the shared memory of the calls they serve); an error where it has none.
pub(crate) fn mma_agrees(like: &CubeTensor, operand: Operand, head: usize) -> Result<(), String> {
    let plans = MmaPlan::all_for_device(like.client.properties(), head, operand);
    if plans.is_empty() {
        return Err(format!("no {operand:?} fragments for heads of {head}"));
    }
    for plan in plans {
        // Inputs in -2..2: scores spread enough that a row's running maximum moves between
        // tiles.
        super::route::agrees_with_fused(
            like,
            operand.projection(),
            [100, head],
            4.0,
            |qkv, seed, grad, heads, dropout| {
                let (out, lse) = mma_forward(qkv.clone(), seed.clone(), heads, dropout, plan);
                let dqkv = mma_backward(
                    qkv.clone(),
                    seed.clone(),
                    out.clone(),
                    lse.clone(),
                    grad.clone(),
                    heads,
                    dropout,
                    plan,
                );
                (out, lse, dqkv)
            },
        )
        .map_err(|why| {
            format!(
                "blocks of {} rows, tiles of {}: {why}",
                plan.rows(),
                plan.cols
            )
        })?;
    }
    Ok(())
}

/// Launches `$kernel::launch::<f32, E, I>` (`E` the plan's operand type, `I` the projection's
/// type it follows) on `$client` with its
/// tensors `$tensor`s and the arguments every tensor-core kernel takes after them: the scale,
/// the dropout mask's threshold and keep scale, and the comptime sizes of `$dims` and `$plan`.
macro_rules! launch_in {
    ($plan:expr, $dims:expr, $dropout:expr, $kernel:path, $client:expr, $count:expr, $dim:expr,
     $($tensor:expr),* $(,)?) => {{
        use $kernel as kernel;
        let (plan, dims, dropout): (MmaPlan, &Dims, f32) = ($plan, $dims, $dropout);
        macro_rules! with {
            ($e:ty, $i:ty) => {
                kernel::launch::<f32, $e, $i>(
                    $client,
                    $count,
                    $dim,
                    $($tensor,)*
                    dims.scale(),
                    crate::cube::hashed_mask::threshold(dropout),
                    1.0 / (1.0 - dropout),
                    dims.k(),
                    dims.heads,
                    dropout > 0.0,
                    plan.shape,
                    plan.rows(),
                    plan.cols,
                    plan.parts,
                )
            };
        }
        match plan.operand {
            Operand::Tf32 => with!(tf32, f32),
            Operand::F16 => with!(f16, f16),
            Operand::Bf16 => with!(bf16, bf16),
        }
    }};
}

/// The forward pass on tensor cores: the output `[B, T, D]` (in the projection's type) and the
/// log-sum-exps `[B, H, T]` (`f32`) of a contiguous projection of the type `plan`'s operand
/// follows (`f32` for TF32, bf16, f16), read as it is.
pub(crate) fn mma_forward(
    qkv: CubeTensor,
    seed: CubeTensor,
    heads: usize,
    dropout: f32,
    plan: MmaPlan,
) -> (CubeTensor, CubeTensor) {
    plan.operand.check_projection(&qkv);
    let dims = Dims::of(&qkv, heads);
    let out = crate::cube::empty_of(&qkv, [dims.b, dims.t, dims.d], qkv.dtype());
    let lse = crate::cube::empty(&qkv, [dims.b, heads, dims.t]);
    let (count, dim) = plan.launch_size(&dims);
    launch_in!(
        plan,
        &dims,
        dropout,
        kernels::attention_forward_mma,
        &qkv.client.clone(),
        count,
        dim,
        qkv.into_tensor_arg(),
        seed.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
    );
    (out, lse)
}

/// The backward pass on tensor cores: the projection's gradient `[B, T, 3D]` from contiguous
/// tensors of the projection's type (the log-sum-exps `f32`), in that type.
#[allow(clippy::too_many_arguments)]
pub(crate) fn mma_backward(
    qkv: CubeTensor,
    seed: CubeTensor,
    out: CubeTensor,
    lse: CubeTensor,
    grad: CubeTensor,
    heads: usize,
    dropout: f32,
    plan: MmaPlan,
) -> CubeTensor {
    for x in [&qkv, &out, &grad] {
        plan.operand.check_projection(x);
    }
    let dims = Dims::of(&qkv, heads);
    let dqkv = crate::cube::empty_of(&qkv, [dims.b, dims.t, 3 * dims.d], qkv.dtype());
    let delta = crate::cube::empty(&qkv, [dims.b, heads, dims.t]);
    let client = qkv.client.clone();
    let (count, dim) = plan.launch_size(&dims);
    launch_in!(
        plan,
        &dims,
        dropout,
        kernels::attention_backward_query_mma,
        &client,
        count.clone(),
        dim,
        qkv.clone().into_tensor_arg(),
        seed.clone().into_tensor_arg(),
        out.into_tensor_arg(),
        grad.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        delta.clone().into_tensor_arg(),
        dqkv.clone().into_tensor_arg(),
    );
    launch_in!(
        plan,
        &dims,
        dropout,
        kernels::attention_backward_key_value_mma,
        &client,
        count,
        dim,
        qkv.into_tensor_arg(),
        seed.into_tensor_arg(),
        grad.into_tensor_arg(),
        lse.into_tensor_arg(),
        delta.into_tensor_arg(),
        dqkv.clone().into_tensor_arg(),
    );
    dqkv
}
