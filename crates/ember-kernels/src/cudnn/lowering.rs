//! A [`Graph`] lowered to cuDNN's backend API (the descriptors cudnn-frontend builds for it):
//! one tensor descriptor per tensor, one operation descriptor per operation, the operation
//! graph, heuristics' engine configurations (mode A, as PyTorch asks), and the first execution
//! plan that cuDNN finalizes for it. A [`Plan`] owns every descriptor it was built from and is
//! executed with a variant pack of device (and host scalar) pointers per call.

use super::graph::{DataType, Graph, Op, Pointwise, Reduce, Scalar, Storage, Uid};
use super::library::{self, Api, Status};
use cudarc::cudnn::sys::{
    self, cudnnBackendAttributeName_t as Name, cudnnBackendAttributeType_t as Type,
    cudnnBackendDescriptorType_t as Kind,
};
use std::collections::HashMap;
use std::ffi::{CStr, c_void};
use std::sync::Arc;

/// A failed cuDNN call: what was asked, cuDNN's status and its last error message.
#[derive(Debug, Clone)]
pub(crate) struct CudnnError(pub String);

impl std::fmt::Display for CudnnError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// cuDNN's functions (loaded: a plan exists only where they are).
fn api() -> Result<&'static Api, CudnnError> {
    library::api().map_err(CudnnError)
}

/// `status` as a result, the error naming `what`, the status and cuDNN's own message.
pub(crate) fn check(status: Status, what: &str) -> Result<(), CudnnError> {
    if status == 0 {
        return Ok(());
    }
    let api = api()?;
    // SAFETY: cuDNN returns a static string for a status, and writes at most `len` bytes of its
    // last message into the buffer.
    let (name, message) = unsafe {
        let name = CStr::from_ptr((api.error_string)(status))
            .to_string_lossy()
            .into_owned();
        let mut buffer = vec![0 as std::ffi::c_char; 512];
        (api.last_error)(buffer.as_mut_ptr(), buffer.len());
        (
            name,
            CStr::from_ptr(buffer.as_ptr())
                .to_string_lossy()
                .into_owned(),
        )
    };
    let message = match message.trim().is_empty() {
        true => String::new(),
        false => format!(": {}", message.trim()),
    };
    Err(CudnnError(format!("{what}: {name}{message}")))
}

/// One backend descriptor, destroyed when dropped.
pub(crate) struct Descriptor(sys::cudnnBackendDescriptor_t);

// SAFETY: a descriptor is used by one thread at a time (plans sit behind a lock while they
// execute); cuDNN does not tie descriptors to threads.
unsafe impl Send for Descriptor {}
unsafe impl Sync for Descriptor {}

impl Drop for Descriptor {
    fn drop(&mut self) {
        // SAFETY: created by `Descriptor::new`, destroyed once.
        if let Ok(api) = library::api() {
            unsafe {
                let _ = (api.destroy_descriptor)(self.0);
            }
        }
    }
}

impl Descriptor {
    fn new(kind: Kind) -> Result<Self, CudnnError> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: writes a new descriptor into `raw`.
        check(
            unsafe { (api()?.create_descriptor)(kind, &mut raw) },
            &format!("create {kind:?}"),
        )?;
        Ok(Self(raw))
    }

    /// Sets attribute `name` to `values` of cuDNN type `ty` (the caller matches `T` to `ty`).
    fn set<T>(&self, name: Name, ty: Type, values: &[T]) -> Result<&Self, CudnnError> {
        // SAFETY: `values` holds `len` elements of the type `ty` names (the callers' pairs).
        let status = unsafe {
            (api()?.set_attribute)(
                self.0,
                name,
                ty,
                values.len() as i64,
                values.as_ptr() as *const c_void,
            )
        };
        check(status, &format!("set {name:?}"))?;
        Ok(self)
    }

    fn set_descriptors(&self, name: Name, values: &[&Descriptor]) -> Result<&Self, CudnnError> {
        let raw: Vec<sys::cudnnBackendDescriptor_t> = values.iter().map(|d| d.0).collect();
        self.set(name, Type::CUDNN_TYPE_BACKEND_DESCRIPTOR, &raw)
    }

    /// The one `int64` value of attribute `name`; the error names `what` was read.
    fn int64(&self, name: Name, what: &str) -> Result<i64, CudnnError> {
        let (mut value, mut n) = (0i64, 0i64);
        // SAFETY: cuDNN writes at most one int64 into `value`.
        check(
            unsafe {
                (api()?.get_attribute)(
                    self.0,
                    name,
                    Type::CUDNN_TYPE_INT64,
                    1,
                    &mut n,
                    &mut value as *mut i64 as *mut c_void,
                )
            },
            what,
        )?;
        Ok(value)
    }

    fn finalize(&self, what: &str) -> Result<(), CudnnError> {
        // SAFETY: a descriptor of ours with its attributes set.
        check(
            unsafe { (api()?.finalize)(self.0) },
            &format!("finalize {what}"),
        )
    }
}

fn cudnn_type(dtype: DataType) -> sys::cudnnDataType_t {
    use sys::cudnnDataType_t::*;
    match dtype {
        DataType::F32 => CUDNN_DATA_FLOAT,
        DataType::Bf16 => CUDNN_DATA_BFLOAT16,
        DataType::F16 => CUDNN_DATA_HALF,
        DataType::I32 => CUDNN_DATA_INT32,
        DataType::I64 => CUDNN_DATA_INT64,
        DataType::Bool => CUDNN_DATA_BOOLEAN,
    }
}

fn pointwise_mode(mode: Pointwise) -> sys::cudnnPointwiseMode_t {
    use sys::cudnnPointwiseMode_t::*;
    match mode {
        Pointwise::Add => CUDNN_POINTWISE_ADD,
        Pointwise::Sub => CUDNN_POINTWISE_SUB,
        Pointwise::Mul => CUDNN_POINTWISE_MUL,
        Pointwise::Div => CUDNN_POINTWISE_DIV,
        Pointwise::Exp => CUDNN_POINTWISE_EXP,
        Pointwise::Log => CUDNN_POINTWISE_LOG,
        Pointwise::Identity => CUDNN_POINTWISE_IDENTITY,
        Pointwise::GenIndex { .. } => CUDNN_POINTWISE_GEN_INDEX,
        Pointwise::CmpGe => CUDNN_POINTWISE_CMP_GE,
        Pointwise::BinarySelect => CUDNN_POINTWISE_BINARY_SELECT,
    }
}

/// An execution plan of a graph, with everything it was built from.
pub(crate) struct Plan {
    plan: Descriptor,
    /// The tensor, operation, graph and engine descriptors the plan was built from.
    _built_from: Arc<Vec<Descriptor>>,
    /// The uids of the tensors in memory, in the graph's order.
    memory: Vec<Uid>,
    /// The host scalars, by uid (boxed: the variant pack points at them; shared by the plans
    /// of one graph).
    values: Vec<(Uid, Arc<f32>)>,
    /// The work memory cuDNN asks for, in bytes.
    pub workspace: usize,
    /// Which of the heuristics' engines it runs.
    pub engine: String,
}

/// Builds the first plan cuDNN finalizes for `graph` on `handle`'s device.
pub(crate) fn build(handle: sys::cudnnHandle_t, graph: &Graph) -> Result<Plan, CudnnError> {
    let mut plans = build_plans(handle, graph, false)?;
    Ok(plans.remove(0))
}

/// Every plan cuDNN finalizes for `graph` among its heuristics' choices, in their order (for
/// diagnosing which engine computes what).
pub(crate) fn build_every(
    handle: sys::cudnnHandle_t,
    graph: &Graph,
) -> Result<Vec<Plan>, CudnnError> {
    build_plans(handle, graph, true)
}

/// The first plan (or, with `every`, all plans) cuDNN finalizes for `graph`: at least one.
fn build_plans(
    handle: sys::cudnnHandle_t,
    graph: &Graph,
    every: bool,
) -> Result<Vec<Plan>, CudnnError> {
    let mut keep: Vec<Descriptor> = Vec::new();
    let mut tensors: HashMap<Uid, usize> = HashMap::new();
    let mut values = Vec::new();
    for t in &graph.tensors {
        let d = Descriptor::new(Kind::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
        d.set(
            Name::CUDNN_ATTR_TENSOR_DATA_TYPE,
            Type::CUDNN_TYPE_DATA_TYPE,
            &[cudnn_type(t.dtype)],
        )?
        .set(
            Name::CUDNN_ATTR_TENSOR_DIMENSIONS,
            Type::CUDNN_TYPE_INT64,
            &t.dims,
        )?
        .set(
            Name::CUDNN_ATTR_TENSOR_STRIDES,
            Type::CUDNN_TYPE_INT64,
            &t.strides,
        )?
        .set(
            Name::CUDNN_ATTR_TENSOR_UNIQUE_ID,
            Type::CUDNN_TYPE_INT64,
            &[t.uid],
        )?
        .set(
            Name::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT,
            Type::CUDNN_TYPE_INT64,
            &[16i64],
        )?;
        match t.storage {
            Storage::Memory => {}
            Storage::Virtual => {
                d.set(
                    Name::CUDNN_ATTR_TENSOR_IS_VIRTUAL,
                    Type::CUDNN_TYPE_BOOLEAN,
                    &[true],
                )?;
            }
            Storage::Value(Scalar::F32(v)) => {
                d.set(
                    Name::CUDNN_ATTR_TENSOR_IS_BY_VALUE,
                    Type::CUDNN_TYPE_BOOLEAN,
                    &[true],
                )?;
                values.push((t.uid, Arc::new(v)));
            }
        }
        d.finalize(&format!("tensor {}", t.uid))?;
        tensors.insert(t.uid, keep.len());
        keep.push(d);
    }
    let mut ops = Vec::new();
    for op in &graph.ops {
        let (desc, operation) = operation(op, |uid| &keep[tensors[&uid]])?;
        keep.extend(desc);
        ops.push(operation);
    }
    let op_graph = Descriptor::new(Kind::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
    op_graph.set(
        Name::CUDNN_ATTR_OPERATIONGRAPH_HANDLE,
        Type::CUDNN_TYPE_HANDLE,
        &[handle],
    )?;
    op_graph.set_descriptors(
        Name::CUDNN_ATTR_OPERATIONGRAPH_OPS,
        &ops.iter().collect::<Vec<_>>(),
    )?;
    op_graph.finalize("the operation graph")?;
    keep.extend(ops);

    let heuristics = Descriptor::new(Kind::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
    heuristics.set_descriptors(Name::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &[&op_graph])?;
    heuristics.set(
        Name::CUDNN_ATTR_ENGINEHEUR_MODE,
        Type::CUDNN_TYPE_HEUR_MODE,
        &[sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A],
    )?;
    heuristics.finalize("the heuristics")?;
    let mut count = 0i64;
    // SAFETY: asks only for the number of results.
    check(
        unsafe {
            (api()?.get_attribute)(
                heuristics.0,
                Name::CUDNN_ATTR_ENGINEHEUR_RESULTS,
                Type::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                0,
                &mut count,
                std::ptr::null_mut(),
            )
        },
        "count the heuristics' results",
    )?;
    let configs = (0..count.max(0))
        .map(|_| Descriptor::new(Kind::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR))
        .collect::<Result<Vec<_>, _>>()?;
    let mut raw: Vec<sys::cudnnBackendDescriptor_t> = configs.iter().map(|d| d.0).collect();
    let mut returned = 0i64;
    // SAFETY: `raw` holds `count` created engine-configuration descriptors for cuDNN to fill.
    check(
        unsafe {
            (api()?.get_attribute)(
                heuristics.0,
                Name::CUDNN_ATTR_ENGINEHEUR_RESULTS,
                Type::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                count,
                &mut returned,
                raw.as_mut_ptr() as *mut c_void,
            )
        },
        "read the heuristics' results",
    )?;
    let mut last = CudnnError("cuDNN's heuristics offered no engine for the graph".into());
    let mut found = Vec::new();
    for (choice, config) in configs.iter().enumerate().take(returned.max(0) as usize) {
        let plan = Descriptor::new(Kind::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
        plan.set(
            Name::CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
            Type::CUDNN_TYPE_HANDLE,
            &[handle],
        )?;
        plan.set_descriptors(Name::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, &[config])?;
        match plan.finalize(&format!("execution plan {choice}")) {
            Ok(()) => {
                let engine = format!(
                    "heuristic choice {choice} of {returned}, engine {}",
                    engine_index(config).map_or("?".into(), |i| i.to_string())
                );
                found.push((engine, plan));
                if !every {
                    break;
                }
            }
            Err(e) => last = e,
        }
    }
    if found.is_empty() {
        return Err(last);
    }
    keep.push(op_graph);
    keep.push(heuristics);
    keep.extend(configs);
    let keep = Arc::new(keep);
    found
        .into_iter()
        .map(|(engine, plan)| {
            let workspace = plan.int64(
                Name::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                "read the plan's workspace size",
            )?;
            Ok(Plan {
                plan,
                _built_from: keep.clone(),
                memory: graph.memory_uids(),
                values: values.clone(),
                workspace: workspace.max(0) as usize,
                engine,
            })
        })
        .collect()
}

/// The global index of the engine an engine configuration names (cuDNN's engine numbering).
fn engine_index(config: &Descriptor) -> Option<i64> {
    let engine = Descriptor::new(Kind::CUDNN_BACKEND_ENGINE_DESCRIPTOR).ok()?;
    let mut raw = engine.0;
    let mut n = 0i64;
    // SAFETY: cuDNN fills the engine descriptor created above.
    check(
        unsafe {
            (api().ok()?.get_attribute)(
                config.0,
                Name::CUDNN_ATTR_ENGINECFG_ENGINE,
                Type::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                1,
                &mut n,
                &mut raw as *mut sys::cudnnBackendDescriptor_t as *mut c_void,
            )
        },
        "read the configuration's engine",
    )
    .ok()?;
    engine
        .int64(
            Name::CUDNN_ATTR_ENGINE_GLOBAL_INDEX,
            "read the engine's index",
        )
        .ok()
}

/// The operation descriptor of `op` (and the descriptor of its parameters, if it has one),
/// its tensors' descriptors from `tensor`.
fn operation<'a>(
    op: &Op,
    tensor: impl Fn(Uid) -> &'a Descriptor,
) -> Result<(Option<Descriptor>, Descriptor), CudnnError> {
    let float = [sys::cudnnDataType_t::CUDNN_DATA_FLOAT];
    match *op {
        Op::Matmul { a, b, c } => {
            let desc = Descriptor::new(Kind::CUDNN_BACKEND_MATMUL_DESCRIPTOR)?;
            desc.set(
                Name::CUDNN_ATTR_MATMUL_COMP_TYPE,
                Type::CUDNN_TYPE_DATA_TYPE,
                &float,
            )?;
            desc.finalize("a matmul descriptor")?;
            let o = Descriptor::new(Kind::CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR)?;
            o.set_descriptors(Name::CUDNN_ATTR_OPERATION_MATMUL_ADESC, &[tensor(a)])?
                .set_descriptors(Name::CUDNN_ATTR_OPERATION_MATMUL_BDESC, &[tensor(b)])?
                .set_descriptors(Name::CUDNN_ATTR_OPERATION_MATMUL_CDESC, &[tensor(c)])?
                .set_descriptors(Name::CUDNN_ATTR_OPERATION_MATMUL_DESC, &[&desc])?;
            o.finalize(&format!("matmul {a} x {b} -> {c}"))?;
            Ok((Some(desc), o))
        }
        Op::Pointwise {
            mode,
            x,
            b,
            t,
            y,
            compute,
        } => {
            let desc = Descriptor::new(Kind::CUDNN_BACKEND_POINTWISE_DESCRIPTOR)?;
            desc.set(
                Name::CUDNN_ATTR_POINTWISE_MODE,
                Type::CUDNN_TYPE_POINTWISE_MODE,
                &[pointwise_mode(mode)],
            )?
            .set(
                Name::CUDNN_ATTR_POINTWISE_MATH_PREC,
                Type::CUDNN_TYPE_DATA_TYPE,
                &[cudnn_type(compute)],
            )?;
            if let Pointwise::GenIndex { axis } = mode {
                desc.set(
                    Name::CUDNN_ATTR_POINTWISE_AXIS,
                    Type::CUDNN_TYPE_INT64,
                    &[axis],
                )?;
            }
            desc.finalize(&format!("a pointwise {mode:?} descriptor"))?;
            let o = Descriptor::new(Kind::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)?;
            o.set_descriptors(Name::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &[&desc])?
                .set_descriptors(Name::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, &[tensor(x)])?
                .set_descriptors(Name::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, &[tensor(y)])?
                .set(
                    Name::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1,
                    Type::CUDNN_TYPE_FLOAT,
                    &[1f32],
                )?
                .set(
                    Name::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2,
                    Type::CUDNN_TYPE_FLOAT,
                    &[1f32],
                )?;
            if let Some(b) = b {
                o.set_descriptors(Name::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, &[tensor(b)])?;
            }
            if let Some(t) = t {
                o.set_descriptors(Name::CUDNN_ATTR_OPERATION_POINTWISE_TDESC, &[tensor(t)])?;
            }
            o.finalize(&format!("pointwise {mode:?} of {x} -> {y}"))?;
            Ok((Some(desc), o))
        }
        Op::Reduction { mode, x, y } => {
            use sys::cudnnReduceTensorOp_t::*;
            let operator = match mode {
                Reduce::Max => CUDNN_REDUCE_TENSOR_MAX,
                Reduce::Add => CUDNN_REDUCE_TENSOR_ADD,
            };
            let desc = Descriptor::new(Kind::CUDNN_BACKEND_REDUCTION_DESCRIPTOR)?;
            desc.set(
                Name::CUDNN_ATTR_REDUCTION_COMP_TYPE,
                Type::CUDNN_TYPE_DATA_TYPE,
                &float,
            )?
            .set(
                Name::CUDNN_ATTR_REDUCTION_OPERATOR,
                Type::CUDNN_TYPE_REDUCTION_OPERATOR_TYPE,
                &[operator],
            )?;
            desc.finalize("a reduction descriptor")?;
            let o = Descriptor::new(Kind::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR)?;
            o.set_descriptors(Name::CUDNN_ATTR_OPERATION_REDUCTION_XDESC, &[tensor(x)])?
                .set_descriptors(Name::CUDNN_ATTR_OPERATION_REDUCTION_YDESC, &[tensor(y)])?
                .set_descriptors(Name::CUDNN_ATTR_OPERATION_REDUCTION_DESC, &[&desc])?;
            o.finalize(&format!("reduction {mode:?} of {x} -> {y}"))?;
            Ok((Some(desc), o))
        }
        Op::Rng {
            seed,
            offset,
            keep,
            y,
        } => {
            let desc = Descriptor::new(Kind::CUDNN_BACKEND_RNG_DESCRIPTOR)?;
            desc.set(
                Name::CUDNN_ATTR_RNG_DISTRIBUTION,
                Type::CUDNN_TYPE_RNG_DISTRIBUTION,
                &[sys::cudnnRngDistribution_t::CUDNN_RNG_DISTRIBUTION_BERNOULLI],
            )?
            .set(
                Name::CUDNN_ATTR_RNG_BERNOULLI_DIST_PROBABILITY,
                Type::CUDNN_TYPE_DOUBLE,
                &[keep],
            )?;
            desc.finalize("an rng descriptor")?;
            let o = Descriptor::new(Kind::CUDNN_BACKEND_OPERATION_RNG_DESCRIPTOR)?;
            o.set_descriptors(Name::CUDNN_ATTR_OPERATION_RNG_YDESC, &[tensor(y)])?
                .set_descriptors(Name::CUDNN_ATTR_OPERATION_RNG_SEED, &[tensor(seed)])?
                .set_descriptors(Name::CUDNN_ATTR_OPERATION_RNG_DESC, &[&desc])?
                .set_descriptors(
                    Name::CUDNN_ATTR_OPERATION_RNG_OFFSET_DESC,
                    &[tensor(offset)],
                )?;
            o.finalize("the dropout's rng")?;
            Ok((Some(desc), o))
        }
        Op::Reshape { x, y } => {
            let o = Descriptor::new(Kind::CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR)?;
            o.set_descriptors(Name::CUDNN_ATTR_OPERATION_RESHAPE_XDESC, &[tensor(x)])?
                .set_descriptors(Name::CUDNN_ATTR_OPERATION_RESHAPE_YDESC, &[tensor(y)])?;
            o.finalize(&format!("reshape {x} -> {y}"))?;
            Ok((None, o))
        }
    }
}

impl Plan {
    /// The uids whose device addresses [`Plan::execute`] needs.
    pub fn memory_uids(&self) -> &[Uid] {
        &self.memory
    }

    /// Enqueues the plan on `handle`'s stream with the device address of each tensor in
    /// memory (`addresses[i]` for `self.memory_uids()[i]`) and `workspace` bytes of work
    /// memory at `workspace` (at least [`Plan::workspace`]).
    ///
    /// # Safety
    /// Every address is a live device buffer holding its tensor's extent on `handle`'s
    /// device, and nothing else writes them until the stream has run the plan.
    pub unsafe fn execute(
        &self,
        handle: sys::cudnnHandle_t,
        addresses: &[u64],
        workspace: u64,
    ) -> Result<(), CudnnError> {
        assert_eq!(
            addresses.len(),
            self.memory.len(),
            "cuDNN plan: one address per tensor"
        );
        let mut uids: Vec<i64> = self.memory.clone();
        let mut pointers: Vec<*mut c_void> = addresses.iter().map(|&a| a as *mut c_void).collect();
        for (uid, value) in &self.values {
            uids.push(*uid);
            pointers.push(&**value as *const f32 as *mut c_void);
        }
        let pack = Descriptor::new(Kind::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
        pack.set(
            Name::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS,
            Type::CUDNN_TYPE_INT64,
            &uids,
        )?
        .set(
            Name::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
            Type::CUDNN_TYPE_VOID_PTR,
            &pointers,
        )?
        .set(
            Name::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
            Type::CUDNN_TYPE_VOID_PTR,
            &[workspace as *mut c_void],
        )?;
        pack.finalize("the variant pack")?;
        // SAFETY (the caller's): the pack's pointers are live for the plan's run.
        check(
            unsafe { (api()?.execute)(handle, self.plan.0, pack.0) },
            "execute the plan",
        )
    }
}
