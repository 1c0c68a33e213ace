//! The products' tests on wgpu (Burn's `matmul` standing in for cuBLAS) and of each cuBLAS
//! call's layout on the host.

use super::part::{Part, call, product};
use super::*;
use burn::backend::{BackendTensor, DispatchTensorKind};
use burn::tensor::{Device, DeviceKind, Tensor, TensorData};

/// A wgpu tensor of `shape` holding `values`, as the backend's tensor.
pub(crate) fn cube(values: &[f32], shape: [usize; 3]) -> CubeTensor {
    let device = Device::wgpu(DeviceKind::DefaultDevice);
    let x = Tensor::<3>::from_data(TensorData::new(values.to_vec(), shape), &device);
    match x.into_dispatch().kind {
        DispatchTensorKind::Cube(BackendTensor::Float(x)) => x,
        _ => panic!("a wgpu tensor is CubeCL's"),
    }
}

/// Every product the two passes make, with each head's columns, for all sequences in one
/// call and for the second sequence alone, over all rows and over blocks of rows (queries
/// `2..4` against keys `0..4`, keys `1..3` against queries `1..`): the call handed to cuBLAS,
/// computed on the host as BLAS computes it ([`Batched::reference`]), writes each sequence's
/// product of the right matrices into the right rows and columns of the right sequence and
/// nothing else; and the path taken without cuBLAS (Burn's `matmul`, on wgpu) gives the same
/// tensor.
#[test]
fn each_call_reads_and_writes_a_heads_matrices_where_they_lie() {
    let (b, t, heads, k) = (3, 5, 2, 3);
    let d = heads * k;
    let values = |n: usize, seed: usize| -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 37 + seed) % 19) as f32 - 9.0)
            .collect()
    };
    let (qkv_v, grad_v, square_v) = (
        values(b * t * 3 * d, 1),
        values(b * t * d, 2),
        values(b * t * t, 3),
    );
    let (qkv, grad, square) = (
        cube(&qkv_v, [b, t, 3 * d]),
        cube(&grad_v, [b, t, d]),
        cube(&square_v, [b, t, t]),
    );
    let host = |x: &CubeTensor| -> &[f32] {
        match x.shape()[2] {
            w if w == 3 * d => &qkv_v,
            w if w == d => &grad_v,
            _ => &square_v,
        }
    };
    // Element (i, j) of sequence `s`'s matrix of `p`, as read.
    let at = |p: &Part, s: usize, i: usize, j: usize| {
        let [_, rows, width] = p.dims();
        let (r, c) = if p.transposed { (j, i) } else { (i, j) };
        host(p.x)[(p.first + s) * rows * width + (p.row + r) * width + p.col + c]
    };
    for (first, n) in [(0, b), (1, 1)] {
        for h in 0..heads {
            let (q, keys, values_h, dout) = (
                Part::cols(&qkv, h * k, k).from(first),
                Part::cols(&qkv, d + h * k, k).from(first),
                Part::cols(&qkv, 2 * d + h * k, k).from(first),
                Part::cols(&grad, h * k, k).from(first),
            );
            // The square buffers hold the call's sequences from their first one.
            let sq = Part::cols(&square, 0, t);
            // Queries 2..4 against keys 0..4; keys 1..3 against queries 1...
            let q_block = Part::cols(&square, 0, 4).rows(2, 4);
            let k_block = Part::cols(&square, 1, 2).rows(1, t).t();
            // (a, b, alpha, output's width, output's first sequence, row and column)
            let products = [
                (q, keys.t(), 0.5, t, (0, 0, 0)),
                (sq, values_h, 1.0, d, (first, 0, h * k)),
                (sq.t(), dout, 1.0, 3 * d, (first, 0, 2 * d + h * k)),
                (dout, values_h.t(), 1.0, t, (0, 0, 0)),
                (sq, keys, 0.5, 3 * d, (first, 0, h * k)),
                (sq.t(), q, 0.5, 3 * d, (first, 0, d + h * k)),
                (q.rows(2, 4), keys.rows(0, 4).t(), 0.5, t, (0, 2, 0)),
                (q_block, values_h.rows(0, 4), 1.0, d, (first, 2, h * k)),
                (
                    k_block,
                    dout.rows(1, t),
                    1.0,
                    3 * d,
                    (first, 1, 2 * d + h * k),
                ),
                (k_block, q.rows(1, t), 0.5, 3 * d, (first, 1, d + h * k)),
            ];
            for (p, (a, bb, alpha, width, (to, row, col))) in products.into_iter().enumerate() {
                let what = format!("sequences {first}.. ({n}), head {h}, product {p}");
                let out = cube(&vec![0.0; b * t * width], [b, t, width]);
                let batched = call(n, a, bb, &out, (to, row, col));
                let mut blas = vec![f32::NAN; b * t * width];
                batched.reference(host(a.x), host(bb.x), &mut blas, alpha);
                let ([m, inner], [_, cols]) = (a.read_shape(), bb.read_shape());
                for s in 0..b {
                    for i in 0..t {
                        for j in 0..width {
                            let got = blas[(s * t + i) * width + j];
                            if !(to..to + n).contains(&s)
                                || !(row..row + m).contains(&i)
                                || !(col..col + cols).contains(&j)
                            {
                                assert!(got.is_nan(), "{what}: wrote ({s}, {i}, {j})");
                                continue;
                            }
                            let (s, i, j) = (s - to, i - row, j - col);
                            let want: f32 = alpha
                                * (0..inner)
                                    .map(|x| at(&a, s, i, x) * at(&bb, s, x, j))
                                    .sum::<f32>();
                            assert_eq!(got, want, "{what}: ({s}, {i}, {j})");
                        }
                    }
                }
                let burn = product(n, a, bb, alpha, out, (to, row, col));
                let burn = burn_cubecl::ops::into_data_sync(burn)
                    .try_to_vec::<f32>()
                    .unwrap();
                for (e, (x, y)) in burn.iter().zip(&blas).enumerate() {
                    let y = if y.is_nan() { 0.0 } else { *y };
                    assert!(
                        (x - y).abs() <= 1e-4 * y.abs().max(1.0),
                        "{what}, element {e}: Burn's {x}, BLAS's {y}"
                    );
                }
            }
        }
    }
}
