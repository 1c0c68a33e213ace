//! The tensor-core kernels compiled for an H100/H200 (sm_90) without a GPU: CubeCL's LLVM
//! NVPTX backend lowers them to PTX as the CUDA runtime would, for the plans a GPT-2-sized head
//! gets there (TF32 fragments for `f32`, bf16 for mixed precision), with dropout and without.
//! Only the `cuda` feature builds them, in the environment `scripts/setup-cuda.sh` prints, and
//! the lowering links NVIDIA's `libdevice.10.bc` for `exp` and `ln`: `CUDA_PATH` names a
//! folder with `nvvm/libdevice/` (a CUDA toolkit, or PyPI's `nvidia-cuda-nvcc-cu12` wheel
//! unpacked: its `nvidia/cuda_nvcc`):
//!
//! ```sh
//! CUDA_PATH=... XDG_DATA_HOME=$PWD/target/cuda-llvm CUDARC_CUDA_VERSION=13000 \
//!     CARGO_TARGET_DIR=target/cuda cargo test --release -p ember-kernels \
//!     --features cudnn,nccl --lib tests_ptx
//! ```
//!
//! With `PTXAS` naming NVIDIA's assembler (PyPI's `nvidia-cuda-nvcc` wheel has it in
//! `nvidia/cu13/bin/`), each kernel is also assembled for `sm_90a` as the driver would, and its
//! registers and spills printed.

use super::kernels;
use super::mma::{MmaPlan, Operand};
use burn::tensor::{bf16, f16};
use burn_cubecl::cubecl::Compiler;
use burn_cubecl::cubecl::ir::features::{Features, MmaConfig};
use burn_cubecl::cubecl::ir::{
    AddressType, DeviceIdentity, ElemType, FloatKind, HardwareProperties, MemoryDeviceProperties,
};
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::cubecl::tf32;
use cubecl_llvm::nvptx::ptx_version::PtxVersion;
use cubecl_llvm::{LlvmTarget, PlironArtifact, PlironCompiler, PlironOptions};
use std::sync::Arc;

/// The PTX of `kernel` for `sm_90`, and the bytes of shared memory a launch of it asks for.
fn ptx_of(kernel: impl CubeKernel) -> (String, usize) {
    let mut compiler = PlironCompiler {
        target: LlvmTarget::Nvptx,
    };
    let options = PlironOptions {
        sm_arch: Some(burn_cubecl::cubecl::ir::nvidia::SmArch::new(90, false)),
        ptx_version: PtxVersion::for_driver(13000),
        ..Default::default()
    };
    let PlironArtifact::NvptxCode(module) = compiler
        .compile(kernel.define(), &options)
        .expect("the kernel lowers to PTX")
    else {
        unreachable!("the NVPTX target produces PTX");
    };
    // SAFETY: the module's PTX is NUL-terminated.
    let ptx = unsafe { std::ffi::CStr::from_ptr(module.ptx.as_ptr()) };
    (
        ptx.to_string_lossy().into_owned(),
        module.shared_memory_size,
    )
}

/// An H200 as CUDA describes it to CubeCL, as far as the plans read it: planes of 32, 227 KiB
/// of shared memory per cube (the opt-in limit), and the fragments NVPTX lowers.
/// Assembles `ptx` for `sm_90a` with NVIDIA's `ptxas` (as the driver does when it loads it),
/// asserting that it assembles, and prints what the assembler reports: registers, spills,
/// shared memory. The PTX and the machine code are left in `target/ptx/` for `nvdisasm`.
fn assembles(ptxas: &std::ffi::OsStr, name: &str, ptx: &str, what: &str) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/ptx");
    std::fs::create_dir_all(&dir).expect("target/ptx is writable");
    let source = dir.join(format!("{name}.ptx"));
    std::fs::write(&source, ptx).expect("the PTX is written");
    let out = std::process::Command::new(ptxas)
        .args(["-arch=sm_90a", "-v", "-o"])
        .arg(dir.join(format!("{name}.cubin")))
        .arg(&source)
        .output()
        .expect("PTXAS names NVIDIA's ptxas");
    let report = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{what}: ptxas refuses {}:\n{report}",
        source.display()
    );
    for line in report
        .lines()
        .filter(|l| l.contains("Used") || l.contains("spill"))
    {
        eprintln!(
            "{what}: ptxas: {}",
            line.trim_start_matches("ptxas info    : ")
        );
    }
}

fn h200() -> DeviceProperties {
    let hardware = HardwareProperties {
        load_width: 128,
        vector_register_count: None,
        plane_size_min: 32,
        plane_size_max: 32,
        max_bindings: 32,
        max_shared_memory_size: 232_448,
        max_cube_count: (u32::MAX, u16::MAX as u32, u16::MAX as u32),
        max_units_per_cube: 1024,
        max_cube_dim: (1024, 1024, 64),
        num_streaming_multiprocessors: Some(132),
        num_tensor_cores: None,
        min_tensor_cores_dim: None,
        num_cpu_cores: None,
        last_level_cache_size: None,
        max_vector_size: VectorSize::MAX,
        cube_mma_reserved_shared_memory: 0,
    };
    let mut props = DeviceProperties::new(
        Features::default(),
        MemoryDeviceProperties::new(u64::MAX, 256),
        hardware,
        burn_cubecl::cubecl::profile::TimingMethod::Device,
        DeviceIdentity {
            name: "H200 (offline)".to_string(),
            ..Default::default()
        },
    );
    let float = |kind| ElemType::Float(kind);
    for (kind, k) in [
        (FloatKind::TF32, 8),
        (FloatKind::BF16, 16),
        (FloatKind::F16, 16),
    ] {
        props.features.matmul.cmma.insert(MmaConfig {
            a_type: float(kind),
            b_type: float(kind),
            cd_type: float(FloatKind::F32),
            m: 16,
            n: 16,
            k,
        });
    }
    props
}

fn tensor() -> TensorCompilationArg {
    TensorCompilationArg {
        meta: TensorMetaCompilationArg { len: (), rank: () },
        buffer: BufferCompilationArg { inplace: None },
    }
}

/// The PTX of the forward pass and of the backward pass's two kernels under `plan`, for heads
/// of 64 (12 of them).
fn kernels_ptx<E: Float + CubeElement, I: Float + CubeElement>(
    plan: MmaPlan,
    dropout: bool,
) -> [(String, usize); 3] {
    let props = Arc::new(h200());
    let target = Arc::new(TargetProperties::default());
    let units = (plan.rows() * plan.parts) as u32;
    // `$kernel` with its tensors (named as in its signature), three scalars and the comptime
    // sizes.
    macro_rules! compiled {
        ($kernel:ty; $($tensor:ident)*) => {
            ptx_of(<$kernel>::new(
                KernelSettings::new(
                    *CubeDim::new_1d(units),
                    ExecutionMode::Checked,
                    AddressType::U32,
                ),
                props.clone(),
                target.clone(),
                $({
                    let $tensor = tensor();
                    $tensor
                },)*
                (),
                (),
                (),
                64,
                12,
                dropout,
                plan.shape,
                plan.rows(),
                plan.cols,
                plan.parts,
            ))
        };
    }
    [
        compiled!(kernels::attention_forward_mma::AttentionForwardMma<f32, E, I>;
            qkv seed out lse),
        compiled!(kernels::attention_backward_query_mma::AttentionBackwardQueryMma<f32, E, I>;
            qkv seed out grad lse delta dqkv),
        compiled!(kernels::attention_backward_key_value_mma::AttentionBackwardKeyValueMma<f32, E, I>;
            qkv seed grad lse delta dqkv),
    ]
}

/// On an H200 a head of 64 gets blocks of 64 rows (4 planes of 16) and 2 units per row, with
/// tiles of 32 rows in TF32 for `f32` and of 64 in bf16 for mixed precision (what fits half the
/// shared memory: two cubes to a multiprocessor), and for timing in TF32 tiles of 64 (what
/// fits all of it); the three kernels of each plan lower to PTX with dropout and without, every
/// product a tensor-core instruction of the operand type (`wmma.mma.sync` on TF32 or bf16
/// fragments accumulating in `f32`), bf16 tensors loaded and stored in 16 bits (as they are,
/// not widened), within the shared memory the plan counted and the device's.
#[test]
fn the_kernels_lower_to_tensor_core_instructions_for_an_h200() {
    let max = h200().hardware.max_shared_memory_size;
    for (operand, kind) in [(Operand::Tf32, "tf32"), (Operand::Bf16, "bf16")] {
        let plans = MmaPlan::all_for_device(&h200(), 64, operand);
        let summary: Vec<_> = plans
            .iter()
            .map(|plan| (plan.shape, plan.planes, plan.cols, plan.parts))
            .collect();
        assert_eq!(
            summary,
            match operand {
                Operand::Tf32 => vec![((16, 16, 8), 4, 32, 2), ((16, 16, 8), 4, 64, 2)],
                _ => vec![((16, 16, 16), 4, 64, 2)],
            },
            "{plans:?}"
        );
        for (plan, dropout) in plans.into_iter().flat_map(|p| [(p, false), (p, true)]) {
            let ptx = match operand {
                Operand::Tf32 => kernels_ptx::<tf32, f32>(plan, dropout),
                Operand::Bf16 => kernels_ptx::<bf16, bf16>(plan, dropout),
                Operand::F16 => kernels_ptx::<f16, f16>(plan, dropout),
            };
            for (name, (ptx, bytes)) in ["forward", "queries' backward", "keys' backward"]
                .iter()
                .zip(&ptx)
            {
                let what = format!("{kind} tiles of {} {name}, dropout {dropout}", plan.cols);
                let products = ptx.lines().filter(|l| l.contains("wmma.mma.sync")).count();
                assert!(products > 0, "{what}: no tensor-core products:\n{ptx}");
                assert!(
                    ptx.lines()
                        .filter(|l| l.contains("wmma.mma.sync"))
                        .all(|l| l.contains(kind) && l.contains("f32")),
                    "{what}: a product of another type"
                );
                // bf16 tensors read and written as they are (16-bit loads and stores), no
                // widened copies.
                let moves = |op: &str| {
                    ptx.lines()
                        .any(|l| l.contains(&format!("{op}.global")) && l.contains("b16"))
                };
                assert_eq!(
                    (moves("ld"), moves("st")),
                    (kind == "bf16", kind == "bf16"),
                    "{what}: 16-bit loads and stores"
                );
                assert!(
                    *bytes > 0 && *bytes <= plan.shared_bytes(64) && *bytes <= max,
                    "{what}: {bytes} bytes of shared memory, the plan counted {} (the device \
                     has {max})",
                    plan.shared_bytes(64)
                );
                eprintln!(
                    "{what}: {products} tensor-core products, {bytes} bytes of shared memory"
                );
                if let Some(ptxas) = std::env::var_os("PTXAS") {
                    let name = format!(
                        "{kind}-{}-{}-{dropout}",
                        plan.cols,
                        name.replace(['\'', ' '], "")
                    );
                    assembles(&ptxas, &name, ptx, &what);
                }
            }
        }
    }
}
