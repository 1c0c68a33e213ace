//! The kernels' launches: the training passes' fused kernels (tiled for head sizes 32 and 64,
//! one row per unit otherwise) and the cached attention of decoding.

use super::dims::{CACHED_UNITS, Dims, TILED_UNITS, Tiled, keys_per_rescale};
use super::kernels;
use burn::backend::TensorMetadata;
use burn::tensor::DType;
use burn_cubecl::cubecl::{CubeCount, CubeDim};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

/// The forward pass in ember's fused kernels (contiguous `qkv`).
pub(crate) fn fused_forward(
    qkv: CubeTensor,
    seed: CubeTensor,
    heads: usize,
    dropout: f32,
) -> (CubeTensor, CubeTensor) {
    assert_eq!(qkv.dtype(), DType::F32, "fused attention kernels: f32 only");
    // The kernels index the buffers as densely packed (CubeCL's CUDA allocator may pad a new
    // tensor's rows, a cast's output for one).
    let qkv = into_contiguous(qkv);
    let dims = Dims::of(&qkv, heads);
    let out = crate::cube::empty(&qkv, [dims.b, dims.t, dims.d]);
    let lse = crate::cube::empty(&qkv, [dims.b, heads, dims.t]);
    if let Some(rows) = dims.tiled_rows(&qkv, Tiled::Forward) {
        kernels::attention_forward_tiled::launch::<f32>(
            &qkv.client.clone(),
            CubeCount::new_2d(dims.t.div_ceil(rows) as u32, (dims.b * heads) as u32),
            CubeDim::new_1d(TILED_UNITS as u32),
            4,
            qkv.into_tensor_arg(),
            seed.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            dims.scale(),
            crate::cube::hashed_mask::threshold(dropout),
            1.0 / (1.0 - dropout),
            dims.k() / 4,
            heads,
            dropout > 0.0,
            rows,
        );
        return (out, lse);
    }
    let (count, dim) = dims.launch_size();
    let tile = dims.tile(&qkv);
    let group = keys_per_rescale(tile);
    let w = dims.lanes(&qkv);
    kernels::attention_forward::launch::<f32>(
        &qkv.client.clone(),
        count,
        dim,
        w,
        qkv.into_tensor_arg(),
        seed.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        dims.scale(),
        crate::cube::hashed_mask::threshold(dropout),
        1.0 / (1.0 - dropout),
        dims.k() / w,
        w,
        heads,
        dropout > 0.0,
        tile,
        group,
    );
    (out, lse)
}

/// The backward pass in ember's fused kernels (contiguous tensors).
pub(crate) fn fused_backward(
    qkv: CubeTensor,
    seed: CubeTensor,
    out: CubeTensor,
    lse: CubeTensor,
    grad: CubeTensor,
    heads: usize,
    dropout: f32,
) -> CubeTensor {
    assert_eq!(qkv.dtype(), DType::F32, "fused attention kernels: f32 only");
    let [qkv, out, lse, grad] = [qkv, out, lse, grad].map(into_contiguous);
    let dims = Dims::of(&qkv, heads);
    let dqkv = crate::cube::empty(&qkv, [dims.b, dims.t, 3 * dims.d]);
    let delta = crate::cube::empty(&qkv, [dims.b, heads, dims.t]);
    let client = qkv.client.clone();
    let (count, dim) = dims.launch_size();
    let tile = dims.tile(&qkv);
    let w = dims.lanes(&qkv);
    if let Some(rows) = dims.tiled_rows(&qkv, Tiled::Queries) {
        kernels::attention_backward_query_tiled::launch::<f32>(
            &client,
            CubeCount::new_2d(dims.t.div_ceil(rows) as u32, (dims.b * heads) as u32),
            CubeDim::new_1d(TILED_UNITS as u32),
            4,
            qkv.clone().into_tensor_arg(),
            seed.clone().into_tensor_arg(),
            out.into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            dqkv.clone().into_tensor_arg(),
            dims.scale(),
            crate::cube::hashed_mask::threshold(dropout),
            1.0 / (1.0 - dropout),
            dims.k() / 4,
            heads,
            dropout > 0.0,
            rows,
        );
    } else {
        kernels::attention_backward_query::launch::<f32>(
            &client,
            count.clone(),
            dim,
            w,
            qkv.clone().into_tensor_arg(),
            seed.clone().into_tensor_arg(),
            out.into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            dqkv.clone().into_tensor_arg(),
            dims.scale(),
            crate::cube::hashed_mask::threshold(dropout),
            1.0 / (1.0 - dropout),
            dims.k() / w,
            w,
            heads,
            dropout > 0.0,
            tile,
        );
    }
    // Keys, then values: two launches of one kernel, each with one row of accumulators
    // per unit (with both, 2K accumulators per unit spilled out of registers on an H100:
    // 18 ms a launch against 1.3 ms for the queries' kernel, before the kernels were
    // tiled; docs/benchmarks.md).
    for values in [false, true] {
        let kernel = if values { Tiled::Values } else { Tiled::Keys };
        if let Some(rows) = dims.tiled_rows(&qkv, kernel) {
            kernels::attention_backward_key_value_tiled::launch::<f32>(
                &client,
                CubeCount::new_2d(dims.t.div_ceil(rows) as u32, (dims.b * heads) as u32),
                CubeDim::new_1d(TILED_UNITS as u32),
                4,
                qkv.clone().into_tensor_arg(),
                seed.clone().into_tensor_arg(),
                grad.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                delta.clone().into_tensor_arg(),
                dqkv.clone().into_tensor_arg(),
                dims.scale(),
                crate::cube::hashed_mask::threshold(dropout),
                1.0 / (1.0 - dropout),
                dims.k() / 4,
                heads,
                dropout > 0.0,
                values,
                rows,
            );
            continue;
        }
        kernels::attention_backward_key_value::launch::<f32>(
            &client,
            count.clone(),
            dim,
            w,
            qkv.clone().into_tensor_arg(),
            seed.clone().into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            dqkv.clone().into_tensor_arg(),
            dims.scale(),
            crate::cube::hashed_mask::threshold(dropout),
            1.0 / (1.0 - dropout),
            dims.k() / w,
            w,
            heads,
            dropout > 0.0,
            values,
            tile,
        );
    }
    dqkv
}

/// Where the cached attention's queries start: a number known when the kernel is launched, or
/// the `[1]` `i32` tensor holding it on the device (a captured step, replayed at each position).
#[allow(clippy::large_enum_variant)] // built once per launch, never stored
pub(super) enum CachedStart {
    Host(u32),
    Device(CubeTensor),
}

/// The cached attention's launch: one cube per query row.
pub(super) fn cached_attention(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    start: CachedStart,
) -> CubeTensor {
    let [b, heads, t, head] = q.shape().dims::<4>();
    assert_eq!(q.dtype(), DType::F32, "cached attention kernel: f32 only");
    let capacity = k.shape().dims::<4>()[2];
    let out = crate::cube::empty(&q, [b, heads, t, head]);
    // One cube per query row: a token's step has one query row per head, too few rows to
    // keep a GPU busy with one unit each (measured on an H100: 350 us per layer and token).
    // A batch of prompts has many rows: in a grid, not one line.
    let client = q.client.clone();
    let (count, dim) = (
        crate::cube::row_grid(b * heads * t),
        CubeDim::new_1d(CACHED_UNITS as u32),
    );
    let scale = 1.0 / (head as f32).sqrt();
    let (q, k, v, o) = (
        q.into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        out.clone().into_tensor_arg(),
    );
    match start {
        CachedStart::Host(start) => kernels::cached_attention::launch::<f32>(
            &client,
            count,
            dim,
            q,
            k,
            v,
            o,
            start,
            scale,
            head,
            capacity,
            CACHED_UNITS,
        ),
        CachedStart::Device(position) => kernels::cached_attention_at::launch::<f32>(
            &client,
            count,
            dim,
            q,
            k,
            v,
            o,
            position.into_tensor_arg(),
            scale,
            head,
            capacity,
            CACHED_UNITS,
        ),
    }
    out
}
