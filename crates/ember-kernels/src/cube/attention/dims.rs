//! The sizes of one call of the training kernels and the rules that follow from them: vectors
//! of 4, the tiled kernels' rows and shared memory, the one-row kernels' tiles and launch grid.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::DType;
use burn_cubecl::cubecl::{CubeCount, CubeDim};
use burn_cubecl::tensor::CubeTensor;

/// `x` in f32 (itself when it is).
pub(crate) fn wide<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    float_cast_to::<B>(x, DType::F32)
}

/// `x` in `dtype` (itself when it is).
pub(crate) fn float_cast_to<B: Backend>(x: FloatTensor<B>, dtype: DType) -> FloatTensor<B> {
    match x.dtype() == dtype {
        true => x,
        false => B::float_cast(x, burn::tensor::FloatDType::from(dtype)),
    }
}

/// Units of the cached attention's cube (one cube per query row): a power of two.
pub(super) const CACHED_UNITS: usize = 128;

/// The sizes of one call of the training kernels.
pub(crate) struct Dims {
    pub(crate) b: usize,
    pub(crate) t: usize,
    pub(crate) d: usize,
    pub(crate) heads: usize,
}

impl Dims {
    pub(crate) fn of(qkv: &CubeTensor, heads: usize) -> Self {
        let [b, t, d3] = qkv.shape().dims::<3>();
        assert!(
            matches!(qkv.dtype(), DType::F32 | DType::BF16 | DType::F16),
            "attention kernels: f32, bf16 or f16, not {:?}",
            qkv.dtype()
        );
        Dims {
            b,
            t,
            d: d3 / 3,
            heads,
        }
    }

    pub(crate) fn k(&self) -> usize {
        self.d / self.heads
    }

    pub(crate) fn scale(&self) -> f32 {
        1.0 / (self.k() as f32).sqrt()
    }

    /// The values of a vector the kernels read and write at once: 4 where a head's columns
    /// are a multiple of 4 and the device reads 4 `f32`s at once, else 1. Every offset the
    /// kernels use is then a multiple of it (heads start at multiples of `K`, rows at
    /// multiples of `D`), and each load of a shared tile gives a unit 4 values for 4 products
    /// instead of 1.
    pub(super) fn lanes(&self, like: &CubeTensor) -> usize {
        let four = self.k().is_multiple_of(4)
            && like
                .client
                .io_optimized_vector_sizes(size_of::<f32>())
                .any(|size| size == 4);
        if four { 4 } else { 1 }
    }

    /// The rows per cube (64, or else 32, whichever shared memory holds) of the register-tiled
    /// `kernel`; `None` where it does not run: [`Dims::tiles_apply`] false.
    pub(super) fn tiled_rows(&self, like: &CubeTensor, kernel: Tiled) -> Option<usize> {
        let max = like.client.properties().hardware.max_shared_memory_size;
        self.tiles_apply(like)
            .then(|| {
                [64, 32]
                    .into_iter()
                    .find(|&rows| kernel.shared_bytes(self.k() / 4, rows) <= max)
            })
            .flatten()
    }

    /// Whether the register-tiled kernels apply: `attention-tiles` on, a head size of 32 or 64,
    /// read as vectors of 4.
    pub(super) fn tiles_apply(&self, like: &CubeTensor) -> bool {
        crate::gpu_kernels::applies(crate::GpuStrategy::AttentionTiles)
            && matches!(self.k(), 32 | 64)
            && self.lanes(like) == 4
    }

    /// One cube per block of rows of one head of one sequence, one unit per row: blocks
    /// along `x`, heads of sequences along `y` (each within a launch's 65535 cubes a side on
    /// every backend). A block is [`ROWS`] rows, or fewer (down to a warp's 32) when the
    /// sequence is shorter, so that short sequences leave fewer units idle.
    pub(super) fn launch_size(&self) -> (CubeCount, CubeDim) {
        let rows = self.t.next_power_of_two().clamp(32, ROWS);
        (
            CubeCount::new_2d(self.t.div_ceil(rows) as u32, (self.b * self.heads) as u32),
            CubeDim::new_1d(rows as u32),
        )
    }

    /// Rows of each tile that a cube streams through shared memory: the most, up to
    /// [`MAX_TILE`], whose two `K`-wide tiles and two scalar columns fit the device's shared
    /// memory (16 KiB on some wgpu adapters, 48 KiB on CUDA GPUs).
    pub(super) fn tile(&self, like: &CubeTensor) -> usize {
        let bytes = like.client.properties().hardware.max_shared_memory_size;
        let mut tile = MAX_TILE;
        while tile > 1 && tile * (2 * self.k() + 2) * size_of::<f32>() > bytes {
            tile /= 2;
        }
        tile
    }
}

/// Rows per cube of the training kernels (units of a cube) for sequences of 64 or more: a
/// multiple of a warp.
pub(super) const ROWS: usize = 64;

/// The most rows of a shared-memory tile.
pub(super) const MAX_TILE: usize = 32;

/// Units per cube of the register-tiled kernels: 8 row groups by 8 column groups.
pub(super) const TILED_UNITS: usize = 64;

/// Rows per tile that the register-tiled kernels stream (keys, or queries for the keys' and
/// values' gradients): 8 column groups of 4 (the kernels' `bc`).
pub(super) const TILED_KEYS: usize = 32;

/// The register-tiled kernels, for the shared memory each needs.
#[derive(Clone, Copy)]
pub(super) enum Tiled {
    Forward,
    Queries,
    Keys,
    Values,
}

impl Tiled {
    /// Bytes of shared memory of a cube of `rows` rows for a head of `row` vectors of 4: what
    /// the kernel declares.
    pub(super) fn shared_bytes(self, row: usize, rows: usize) -> usize {
        let vector = 4 * size_of::<f32>();
        let tile = tile_vectors(row, rows);
        match self {
            // The block's queries, a tile's keys and values, the weights; the rows' 8 partial
            // maxima, maximum and sum.
            Tiled::Forward => {
                (row * (rows + 2 * TILED_KEYS) + TILED_KEYS * rows / 4) * vector
                    + rows * 10 * size_of::<f32>()
            }
            // The block's queries and output gradients (keys and values), two tiles.
            Tiled::Queries | Tiled::Keys => (2 * row * rows + 2 * tile) * vector,
            // The block's keys and one vector in place of its values, two tiles.
            Tiled::Values => (row * rows + 1 + 2 * tile) * vector,
        }
    }
}

/// Vectors of one of the backward kernels' two tiles: transposed tile rows (`row` vectors of
/// the head each) or the weights that replace them (`rows / 4` vectors each), whichever is
/// larger.
pub(super) const fn tile_vectors(row: usize, rows: usize) -> usize {
    let (operand, weights) = (row * TILED_KEYS, TILED_KEYS * rows / 4);
    if operand > weights { operand } else { weights }
}

/// Keys the forward pass scores before it rescales its running output once for all of them
/// (FlashAttention-2's per-block rescale): a power of two, so that it divides every tile of
/// more rows. With one rescale per key, 64 of a key's 266 instructions in the loop were the
/// rescale's multiplications, beside 128 fused multiply-adds (head size 64, the kernel
/// compiled for an H100, sm_90, read offline); 8 keys cost 8 more registers for their scores.
pub(super) const GROUP: usize = 8;

/// Keys per rescale of the one-row forward pass, for tiles of `tile` rows: [`GROUP`] (the
/// policy's `attention.keys_per_rescale` where set), at most the tile.
pub(super) fn keys_per_rescale(tile: usize) -> usize {
    let group = crate::gpu_kernels::policy().attention.keys_per_rescale;
    group.unwrap_or(GROUP).clamp(1, tile.max(1))
}
