//! A cuDNN operation graph written down as plain data: its tensors (their unique ids, shapes,
//! strides, types, and whether they live in memory, only inside the fused kernel, or are host
//! scalars) and its operations in the order they are built.
//!
//! cuDNN fuses a graph into one kernel only when it recognises the pattern (the "runtime
//! fusion" engines), so the graphs here follow NVIDIA's cudnn-frontend node for node and tensor
//! type for tensor type. Keeping them as data lets the same description be lowered to cuDNN's
//! backend descriptors on a GPU (`super::lowering`) and evaluated on the CPU by the tests
//! (`super::interpret`), which hold it to the attention's reference.

/// A tensor's unique id in its graph (cuDNN's `CUDNN_ATTR_TENSOR_UNIQUE_ID`): how the variant
/// pack names the memory of each tensor at execution.
pub(crate) type Uid = i64;

/// The element types the graphs use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum DataType {
    F32,
    Bf16,
    F16,
    I32,
    I64,
    Bool,
}

/// A scalar passed by value (from the host) at execution.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Scalar {
    F32(f32),
}

/// Where a tensor's values live.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Storage {
    /// In device memory the caller passes at execution.
    Memory,
    /// Only inside the fused kernel (cuDNN's virtual tensors).
    Virtual,
    /// A scalar the caller passes from the host (cuDNN's by-value tensors).
    Value(Scalar),
}

/// One tensor of a graph: 4 dimensions (cuDNN's attention graphs are `[B, H, rows, cols]`).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct TensorDesc {
    pub uid: Uid,
    pub dims: [i64; 4],
    pub strides: [i64; 4],
    pub dtype: DataType,
    pub storage: Storage,
}

/// The elementwise operations the graphs use (cuDNN's pointwise modes).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Pointwise {
    Add,
    Sub,
    Mul,
    Div,
    Exp,
    Log,
    Identity,
    /// The index of each element along an axis (its input gives the shape only).
    GenIndex {
        axis: i64,
    },
    /// `x >= b`.
    CmpGe,
    /// `t ? x : b`.
    BinarySelect,
}

/// The reductions the graphs use, over the dimensions where the output has size 1 and the
/// input does not.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Reduce {
    Max,
    Add,
}

/// One operation of a graph, naming its tensors by uid.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Op {
    /// `c = a @ b` over the last two dimensions, batched over the first two.
    Matmul {
        a: Uid,
        b: Uid,
        c: Uid,
    },
    /// `y = mode(x[, b][, t])` with broadcasting, computed in `compute`.
    Pointwise {
        mode: Pointwise,
        x: Uid,
        b: Option<Uid>,
        t: Option<Uid>,
        y: Uid,
        compute: DataType,
    },
    Reduction {
        mode: Reduce,
        x: Uid,
        y: Uid,
    },
    /// A Bernoulli draw per element of `y`: 1 with probability `keep`, else 0, from the
    /// Philox generator at the seed and offset held by the device tensors `seed`, `offset`.
    Rng {
        seed: Uid,
        offset: Uid,
        keep: f64,
        y: Uid,
    },
    /// `y` is `x`'s memory under another shape and strides (how the graphs transpose).
    Reshape {
        x: Uid,
        y: Uid,
    },
}

/// A graph under construction: tensors and operations, virtual and scalar tensors numbered
/// from [`Graph::FIRST_INNER_UID`] on (the caller numbers the tensors in memory below it).
#[derive(Clone, Debug, Default)]
pub(crate) struct Graph {
    pub tensors: Vec<TensorDesc>,
    pub ops: Vec<Op>,
    next_uid: Uid,
}

/// Row-major strides of `dims`.
pub(crate) fn contiguous(dims: [i64; 4]) -> [i64; 4] {
    [dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1]
}

impl Graph {
    /// The first uid of the tensors the graph numbers itself.
    pub const FIRST_INNER_UID: Uid = 100;

    pub fn new() -> Self {
        Self {
            next_uid: Self::FIRST_INNER_UID,
            ..Self::default()
        }
    }

    /// The tensor of uid `uid`.
    pub fn tensor(&self, uid: Uid) -> &TensorDesc {
        self.tensors
            .iter()
            .find(|t| t.uid == uid)
            .unwrap_or_else(|| panic!("graph: no tensor {uid}"))
    }

    /// A tensor in memory, numbered `uid` by the caller.
    pub fn memory(&mut self, uid: Uid, dims: [i64; 4], strides: [i64; 4], dtype: DataType) -> Uid {
        assert!(
            uid < Self::FIRST_INNER_UID,
            "graph: uid {uid} is the graph's own"
        );
        self.push(uid, dims, strides, dtype, Storage::Memory)
    }

    /// A virtual tensor.
    pub fn inner(&mut self, dims: [i64; 4], strides: [i64; 4], dtype: DataType) -> Uid {
        let uid = self.fresh();
        self.push(uid, dims, strides, dtype, Storage::Virtual)
    }

    /// A host scalar (dimensions and strides all 1, as cudnn-frontend gives them).
    pub fn scalar(&mut self, value: f32) -> Uid {
        let uid = self.fresh();
        self.push(
            uid,
            [1; 4],
            [1; 4],
            DataType::F32,
            Storage::Value(Scalar::F32(value)),
        )
    }

    /// `mode(x, b)` into a new virtual tensor of `x`'s shape and strides (or `dims` and
    /// contiguous strides) and type `dtype`, computed in `f32`.
    pub fn pointwise(&mut self, mode: Pointwise, x: Uid, b: Option<Uid>, dtype: DataType) -> Uid {
        let (dims, strides) = {
            let x = self.tensor(x);
            (x.dims, x.strides)
        };
        let y = self.inner(dims, strides, dtype);
        self.pointwise_into(mode, x, b, None, y, DataType::F32);
        y
    }

    /// `mode(x[, b][, t])` into the existing tensor `y`, computed in `compute`.
    pub fn pointwise_into(
        &mut self,
        mode: Pointwise,
        x: Uid,
        b: Option<Uid>,
        t: Option<Uid>,
        y: Uid,
        compute: DataType,
    ) {
        self.ops.push(Op::Pointwise {
            mode,
            x,
            b,
            t,
            y,
            compute,
        });
    }

    /// `x @ y` into the existing tensor `c`.
    pub fn matmul_into(&mut self, a: Uid, b: Uid, c: Uid) {
        self.ops.push(Op::Matmul { a, b, c });
    }

    /// The reduction of `x` into the existing tensor `y`.
    pub fn reduce_into(&mut self, mode: Reduce, x: Uid, y: Uid) {
        self.ops.push(Op::Reduction { mode, x, y });
    }

    /// `x`'s memory as a new virtual tensor of `dims`, `strides` and `dtype`.
    pub fn reshape(&mut self, x: Uid, dims: [i64; 4], strides: [i64; 4], dtype: DataType) -> Uid {
        let y = self.inner(dims, strides, dtype);
        self.ops.push(Op::Reshape { x, y });
        y
    }

    /// A Bernoulli mask of `dims` (contiguous, `f32`) keeping each element with probability
    /// `keep`.
    pub fn rng(&mut self, seed: Uid, offset: Uid, keep: f64, dims: [i64; 4]) -> Uid {
        let y = self.inner(dims, contiguous(dims), DataType::F32);
        self.ops.push(Op::Rng {
            seed,
            offset,
            keep,
            y,
        });
        y
    }

    /// The uids of the tensors the caller passes memory for, in uid order.
    pub fn memory_uids(&self) -> Vec<Uid> {
        let mut uids: Vec<Uid> = (self.tensors.iter())
            .filter(|t| t.storage == Storage::Memory)
            .map(|t| t.uid)
            .collect();
        uids.sort_unstable();
        uids
    }

    fn fresh(&mut self) -> Uid {
        let uid = self.next_uid.max(Self::FIRST_INNER_UID);
        self.next_uid = uid + 1;
        uid
    }

    fn push(
        &mut self,
        uid: Uid,
        dims: [i64; 4],
        strides: [i64; 4],
        dtype: DataType,
        storage: Storage,
    ) -> Uid {
        assert!(
            self.tensors.iter().all(|t| t.uid != uid),
            "graph: tensor {uid} twice"
        );
        self.tensors.push(TensorDesc {
            uid,
            dims,
            strides,
            dtype,
            storage,
        });
        uid
    }
}
