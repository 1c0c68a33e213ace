//! For tests: a [`Graph`] evaluated on the CPU in `f64`, element by element, so that the graphs
//! cuDNN receives are held to the attention's reference without a GPU: each tensor in memory
//! is a view (offset, dimensions, strides) into a caller's buffer, exactly as cuDNN reads and
//! writes it; a virtual tensor gets a buffer of its own laid out by its strides; a reshape reads
//! its input's memory under new dimensions and strides.

use super::graph::{Graph, Op, Pointwise, Reduce, Storage, TensorDesc, Uid};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

/// A buffer several views may share.
pub(crate) type Buffer = Rc<RefCell<Vec<f64>>>;

/// A tensor's memory: its buffer and where it starts there.
#[derive(Clone)]
struct View {
    buffer: Buffer,
    offset: i64,
}

/// Runs `graph` with the tensors in memory at `memory` (uid to buffer and element offset):
/// their buffers hold the inputs and receive the outputs. `mask` gives the Bernoulli draw of a
/// random-number operation (0 or 1) at `[b, h, row, col]`.
pub(crate) fn run(
    graph: &Graph,
    memory: &HashMap<Uid, (Buffer, i64)>,
    mask: &dyn Fn([i64; 4]) -> f64,
) {
    let mut views: HashMap<Uid, View> = HashMap::new();
    for t in &graph.tensors {
        let view = match t.storage {
            Storage::Memory => {
                let (buffer, offset) = memory
                    .get(&t.uid)
                    .unwrap_or_else(|| panic!("interpret: no memory for tensor {}", t.uid));
                View {
                    buffer: buffer.clone(),
                    offset: *offset,
                }
            }
            Storage::Virtual => View {
                buffer: Rc::new(RefCell::new(vec![f64::NAN; span(t)])),
                offset: 0,
            },
            Storage::Value(super::graph::Scalar::F32(v)) => View {
                buffer: Rc::new(RefCell::new(vec![f64::from(v)])),
                offset: 0,
            },
        };
        views.insert(t.uid, view);
    }
    for op in &graph.ops {
        match *op {
            Op::Reshape { x, y } => {
                let alias = views[&x].clone();
                views.insert(y, alias);
            }
            Op::Pointwise {
                mode, x, b, t, y, ..
            } => {
                let out = graph.tensor(y);
                for at in indices(out.dims) {
                    let read = |uid: Option<Uid>| uid.map(|u| load(graph, &views, u, at));
                    let (xv, bv, tv) = (read(Some(x)).unwrap(), read(b), read(t));
                    let value = match mode {
                        Pointwise::Add => xv + bv.unwrap(),
                        Pointwise::Sub => xv - bv.unwrap(),
                        Pointwise::Mul => xv * bv.unwrap(),
                        Pointwise::Div => xv / bv.unwrap(),
                        Pointwise::Exp => xv.exp(),
                        Pointwise::Log => xv.ln(),
                        Pointwise::Identity => xv,
                        Pointwise::GenIndex { axis } => at[axis as usize] as f64,
                        Pointwise::CmpGe => f64::from(u8::from(xv >= bv.unwrap())),
                        Pointwise::BinarySelect => match tv.unwrap() != 0.0 {
                            true => xv,
                            false => bv.unwrap(),
                        },
                    };
                    store(graph, &views, y, at, value);
                }
            }
            Op::Reduction { mode, x, y } => {
                let (input, out) = (graph.tensor(x), graph.tensor(y));
                let start = match mode {
                    Reduce::Max => f64::NEG_INFINITY,
                    Reduce::Add => 0.0,
                };
                for at in indices(out.dims) {
                    store(graph, &views, y, at, start);
                }
                for at in indices(input.dims) {
                    let target = broadcast(out, at);
                    let (now, v) = (load(graph, &views, y, target), load(graph, &views, x, at));
                    let value = match mode {
                        Reduce::Max => now.max(v),
                        Reduce::Add => now + v,
                    };
                    store(graph, &views, y, target, value);
                }
            }
            Op::Matmul { a, b, c } => {
                let inner = graph.tensor(a).dims[3];
                assert_eq!(inner, graph.tensor(b).dims[2], "interpret: matmul shapes");
                for at in indices(graph.tensor(c).dims) {
                    let mut sum = 0.0;
                    for i in 0..inner {
                        let av = load(graph, &views, a, [at[0], at[1], at[2], i]);
                        let bv = load(graph, &views, b, [at[0], at[1], i, at[3]]);
                        sum += av * bv;
                    }
                    store(graph, &views, c, at, sum);
                }
            }
            Op::Rng { y, .. } => {
                for at in indices(graph.tensor(y).dims) {
                    store(graph, &views, y, at, mask(at));
                }
            }
        }
    }
}

/// How many elements a tensor's strides reach, plus one.
fn span(t: &TensorDesc) -> usize {
    let last: i64 = (0..4).map(|i| (t.dims[i] - 1).max(0) * t.strides[i]).sum();
    last as usize + 1
}

/// Every index of `dims`, row-major.
fn indices(dims: [i64; 4]) -> impl Iterator<Item = [i64; 4]> {
    let total: i64 = dims.iter().product();
    (0..total).map(move |mut n| {
        let mut at = [0; 4];
        for i in (0..4).rev() {
            at[i] = n % dims[i];
            n /= dims[i];
        }
        at
    })
}

/// `at` in `t`, its size-1 dimensions broadcast.
fn broadcast(t: &TensorDesc, at: [i64; 4]) -> [i64; 4] {
    let mut at = at;
    for (a, &dim) in at.iter_mut().zip(&t.dims) {
        if dim == 1 {
            *a = 0;
        }
    }
    at
}

fn element(graph: &Graph, views: &HashMap<Uid, View>, uid: Uid, at: [i64; 4]) -> (Buffer, usize) {
    let t = graph.tensor(uid);
    let at = broadcast(t, at);
    let view = &views[&uid];
    let offset: i64 = view.offset + (0..4).map(|i| at[i] * t.strides[i]).sum::<i64>();
    (view.buffer.clone(), offset as usize)
}

fn load(graph: &Graph, views: &HashMap<Uid, View>, uid: Uid, at: [i64; 4]) -> f64 {
    let (buffer, i) = element(graph, views, uid, at);
    buffer.borrow()[i]
}

fn store(graph: &Graph, views: &HashMap<Uid, View>, uid: Uid, at: [i64; 4], value: f64) {
    let (buffer, i) = element(graph, views, uid, at);
    buffer.borrow_mut()[i] = value;
}
