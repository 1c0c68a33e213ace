#!/usr/bin/env bash
# GPU benchmark (not CI; needs a GPU machine with PyTorch for the reference): ember on a GPU
# device against PyTorch eager on CUDA, with nanoGPT's GPU config
# (configs/shakespeare-char-gpu.toml: 6 layers, 6 heads, width 384, context 256, batch 64).
#
#   DEVICE=cuda bash scripts/bench-gpu.sh preflight # does the default path train? else what off
#   DEVICE=vulkan bash scripts/bench-gpu.sh check   # tiny run on flex and on DEVICE, compared
#   DEVICE=vulkan bash scripts/bench-gpu.sh speed   # ms/step of ember and PyTorch, generation
#   DEVICE=vulkan bash scripts/bench-gpu.sh full    # nanoGPT's 5000 iterations: time, val loss
#   DEVICE=vulkan bash scripts/bench-gpu.sh profile # where a step's time goes, kernel by kernel
#                                                   # (PROFILE_MODEL=gpt2: GPT-2 124M's body)
#   DEVICE=vulkan bash scripts/bench-gpu.sh memory  # what a step holds: in use, pools, process
#   bash scripts/bench-gpu.sh reference             # the same 5000 iterations in PyTorch eager
#   DEVICE=vulkan bash scripts/bench-gpu.sh host    # where a sampled token's host time goes
#                                                   # (HOST_RUN=train: a training step's, at PRECISION)
#   DEVICE=cuda bash scripts/bench-gpu.sh kernels   # what limits each attention kernel (ncu)
#   DEVICE=cuda bash scripts/bench-gpu.sh cudnn     # cuDNN's flash attention: found, checked, run
#   DEVICE=cuda bash scripts/bench-gpu.sh gpt2      # GPT-2 124M's body: ember and PyTorch, ms/step
#   DEVICE=cuda bash scripts/bench-gpu.sh paths     # the attention's paths timed, shape by shape
#   DEVICE=cuda bash scripts/bench-gpu.sh mt        # translation: ember and PyTorch, tokens/s
#   DEVICE=cuda bash scripts/bench-gpu.sh nccl      # NCCL at world size 1 (torchrun's variables) vs none
#   DEVICE=cuda bash scripts/bench-gpu.sh firstrun  # a first generation with and without the caches
#   DEVICE=cuda BUDGET=550 bash scripts/bench-gpu.sh all  # speed, check, profile, memory, full
#                                                   # in BUDGET seconds (for a GPU available briefly)
#
# For CUDA: EMBER=./target/cuda/release/ember DEVICE=cuda (the binary `bash scripts/setup-cuda.sh
# --build` makes; it travels as target/cuda/release/ember-cuda.xz, `xz -d` it there).
# EMBER is the binary (default ./target/release/ember, built with
# `cargo build --release -p ember-cli --features wgpu,vulkan,fusion`: fusion makes training
# 2.2x faster and sampling 25x slower on an H100); EMBER_GEN the binary that samples (default
# EMBER; one built without `fusion` samples fast); RUNS the folder for runs;
# CONFIG the ember config (the PyTorch reference is always the GPU config); STEPS the steps
# the speed stage times (default 60); PYTHON the PyTorch interpreter and
# TORCH_DEVICE its device (default cuda); ROUNDS how many times `speed` trains ember with and
# without its GPU kernels (EMBER_GPU_KERNELS=on/off) and with bf16 products, alternating
# (default 1); SPEED_RUNS those runs, each PRECISION:EMBER_GPU_KERNELS[:EMBER_SPLIT_K]
# (default `f32:on f32:-attention-products f32:-attention-products,-attention-tiles f32:-cublas
# bf16:on bf16:-attention-products bf16:-cublas`: the attention as cuBLAS's products, as the
# fused tiled kernels, as the one-row kernels, and in bf16 as products of the bf16 projection
# or as the fused kernels on its widened copy; e.g. `f32:-layer-norm f32:-norm` to time one
# kernel's part, `f32:-cublas,-split-k` for cubek's products in one piece, `f32:-cublas:4
# f32:-cublas:16` for cubek's weight gradients in 4 and 16 chunks of rows); GEN_KERNELS the EMBER_GPU_KERNELS settings `speed` samples with (default `on -step-graph`,
# the first also without the cache; each sampled twice, the second run the figure); PRECISION
# the precision of `full` and `memory` (f32 or bf16, default f32); FULL_SEEDS the seeds `full`
# trains with, one run each (default the config's), each `seed` or `seed:EMBER_GPU_KERNELS`
# (e.g. `config 7 7:-eval-graph`); SPEED_TORCH PyTorch's runs in `speed`
# (default `f32 f32-compile bf16`: f32 is TF32 on CUDA, `-compile` adds torch.compile); MEMORY_RUNS the runs of `memory`,
# each EMBER_GPU_KERNELS:persistent_memory (cubecl's setting; default `on:enabled on:size-match
# -attention-products:enabled`); PROFILE_STEPS the steps `profile` times
# (default 10, after STEPS - PROFILE_STEPS to warm up). Every ember and PyTorch run on an
# NVIDIA GPU also prints the most GPU memory its process held (nvidia-smi, polled every 0.2 s:
# the same yardstick for both, CUDA context included). STAGES the stages of `all`, each
# `stage[@device]:seconds` (default `speed:300 check:90 profile:110 memory:70 full:100000`; e.g.
# `speed@cuda:200 speed@vulkan:150 check@vulkan:60 ...` for two devices of one binary in one
# run). ENV_ARCHIVE a `tar.xz` of cubecl's environment (target/environment/: autotune results
# and compiled kernels; with the driver's ~/.nv/ComputeCache where it is under 40 MB) to start
# from, written by an earlier `all` as $OUT/environment.tar.xz where OUT is set (the GPU
# machine's folder that comes back): a fresh machine otherwise spends 40-80 s compiling and
# tuning before its first steps. Backends draw
# initial weights from their own random generators, so the two tiny runs of `check` end near
# each other, not equal; the greedy text of one checkpoint must agree.
set -euo pipefail
cd "$(dirname "$0")/.."

EMBER=${EMBER:-./target/release/ember}
EMBER_GEN=${EMBER_GEN:-$EMBER}
DEVICE=${DEVICE:-vulkan}
RUNS=${RUNS:-runs/bench-gpu}
# wgpu's Vulkan backend complains on every start without it (headless machines often lack it).
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp}
STEPS=${STEPS:-60}
PYTHON=${PYTHON:-python3}
TORCH_DEVICE=${TORCH_DEVICE:-cuda}
CONFIG=${CONFIG:-configs/shakespeare-char-gpu.toml}
# GPT-2 124M's body on the GPU config's character vocabulary and recipe (`gpt2`, `profile`),
# as ember's settings and as torch_reference.py's arguments.
GPT2_SIZE=(--set model.d_model=768 --set model.n_heads=12 --set model.n_layers=12
    --set model.context_len=1024 --set training.batch_size=16)
GPT2_TORCH_SIZE=(--d-model 768 --heads 12 --layers 12 --context 1024 --batch 16)
mkdir -p "$RUNS"
# ember's cuDNN: the one PyTorch's wheels bring (nvidia/cudnn/lib beside torch), so that both
# run the same flash attention, unless CUDNN_PATH names another (ember's own default is the
# system's, then PyTorch's: README, Devices).
if [ -z "${CUDNN_PATH:-}" ]; then
    CUDNN_PATH=$("$PYTHON" -c 'import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], "cudnn", "lib"))' 2>/dev/null) || true
    [ -n "$CUDNN_PATH" ] && [ -e "$CUDNN_PATH/libcudnn.so.9" ] && export CUDNN_PATH || unset CUDNN_PATH
fi
# ember's NCCL (training across processes): the one PyTorch's wheels bring, unless NCCL_PATH
# names another (ember's own default is the system's, then PyTorch's: README, Training across
# processes).
if [ -z "${NCCL_PATH:-}" ]; then
    NCCL_PATH=$("$PYTHON" -c 'import glob, os, nvidia; print((sorted(glob.glob(os.path.join(list(nvidia.__path__)[0], "**", "libnccl.so.2"), recursive=True)) or [""])[0])' 2>/dev/null) || true
    [ -n "$NCCL_PATH" ] && export NCCL_PATH || unset NCCL_PATH
fi
if [ -n "${ENV_ARCHIVE:-}" ]; then
    if [ -f "$ENV_ARCHIVE" ]; then
        tar -xJf "$ENV_ARCHIVE" && echo "cubecl environment from $ENV_ARCHIVE"
        # The driver's cache of the kernels it compiled from CubeCL's PTX, where the archive
        # has it (it belongs in the home folder).
        if [ -d .nv/ComputeCache ]; then
            mkdir -p "$HOME/.nv" && cp -r .nv/ComputeCache "$HOME/.nv/" && rm -rf .nv &&
                echo "the driver's compiled kernels from $ENV_ARCHIVE"
        fi
    else
        echo "ENV_ARCHIVE=$ENV_ARCHIVE is not a file; starting from a cold cache"
    fi
    # Once: the stages `all` runs are children of this script.
    unset ENV_ARCHIVE
fi

# Runs a command; where nvidia-smi answers, polls the GPU memory its process holds and prints
# the peak when it ends. Returns the command's status.
with_gpu_peak() {
    "$@" &
    local pid=$! peak=0 used status=0
    if command -v nvidia-smi >/dev/null; then
        while kill -0 "$pid" 2>/dev/null; do
            used=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits \
                2>/dev/null | awk -F', *' -v p="$pid" '$1 == p { print $2 }')
            if [ -n "$used" ] && [ "$used" -gt "$peak" ]; then
                peak=$used
            fi
            sleep 0.2
        done
    fi
    wait "$pid" || status=$?
    if command -v nvidia-smi >/dev/null; then
        echo "peak GPU memory: $peak MiB (nvidia-smi, this process)"
    fi
    return "$status"
}

# Runs a command with its output in log file $1; on failure says so with the log's end.
logged() {
    local log=$1
    shift
    echo "\$ $*"
    local status=0
    with_gpu_peak "$@" >"$log" 2>&1 || status=$?
    if [ "$status" -ne 0 ]; then
        echo "FAILED (exit status $status); the end of $log:"
        tail -5 "$log"
        return 1
    fi
}

# PyTorch's precision for ember's f32 on DEVICE: f32 with TF32 tensor-core products on CUDA
# (sm80 and newer, as cubek's), plain f32 elsewhere (Vulkan has no TF32).
torch_f32() {
    if [ "${DEVICE%%:*}" = cuda ]; then echo tf32; else echo fp32; fi
}

# Prints the median ms/step over the logged intervals of run folder $1 after the first (warm-up).
ms_per_step() {
    "$PYTHON" - "$1/metrics.jsonl" "$DEVICE" <<'EOF'
import json, sys
logs = [json.loads(l) for l in open(sys.argv[1]) if '"kind":"log"' in l]
ms = sorted(1000 * (b["elapsed_secs"] - a["elapsed_secs"]) / (b["step"] - a["step"])
            for a, b in zip(logs[1:], logs[2:]))
median = f"{ms[len(ms) // 2]:.1f}" if ms else "n/a"
print(f"ember {sys.argv[2]}: {median} ms/step (median of the logged intervals)")
EOF
}

# EMBER_GPU_KERNELS value $1 with the switches `preflight` turned off (KERNELS_OFF, set by
# `all` from its finding) also off: `on` becomes that list, a list of switches to turn off
# gains it; `off` and a list of switches to keep stay as they are.
with_off() {
    local k=$1
    if [ -z "${KERNELS_OFF:-}" ]; then
        echo "$k"
        return
    fi
    case $k in
    "" | on) echo "$KERNELS_OFF" ;;
    -*) echo "$k,$KERNELS_OFF" ;;
    *) echo "$k" ;;
    esac
}

# Whether the default GPU path trains at all before the stages time it: nanoGPT's GPU config
# for 30 steps in bf16 (cuDNN's attention, an evaluation at step 20 replayed from a recording,
# a checkpoint written by its thread) and in f32 at context 1024 (the attention's paths timed
# against each other, in blocks of query rows), with every switch on; where either run fails,
# the same with each setting of PREFLIGHT_FALLBACKS in turn (default `-async-products` and
# every strategy not yet run on a GPU). The first setting under which both train is written to
# RUNS/kernels-off, and `all` then adds it to every later stage's EMBER_GPU_KERNELS (`with_off`),
# so that one fault does not cost the stages after it. The compilations and tunings of its runs
# are kept for the stages after.
preflight() {
    local fallbacks=${PREFLIGHT_FALLBACKS:--async-products -async-products,-eval-graph,-grouped-adamw,-weight-copies,-mixed-products,-attention-tune,-causal-blocks}
    local setting status
    rm -f "$RUNS/kernels-off"
    for setting in on $fallbacks; do
        status=0
        for precision in bf16 f32; do
            local size=()
            [ "$precision" = f32 ] && size=(--set model.context_len=1024 --set training.batch_size=16)
            rm -rf "$RUNS/preflight"
            echo "preflight: $precision, EMBER_GPU_KERNELS=$setting"
            EMBER_GPU_KERNELS=$setting logged "$RUNS/preflight.log" "$EMBER" train --config "$CONFIG" \
                --device "$DEVICE" --out "$RUNS/preflight" --stop-after 30 "${size[@]}" \
                --set "training.precision=\"$precision\"" --set training.eval_interval=20 \
                --set training.eval_batches=4 --set training.log_interval=10 || status=1
            grep -aE "^(step .*val|done|warning|attention)" "$RUNS/preflight.log" || true
            [ "$status" = 0 ] || break
        done
        if [ "$status" = 0 ]; then
            if [ "$setting" = on ]; then
                echo "preflight: every switch on trains"
            else
                echo "preflight: trains with EMBER_GPU_KERNELS=$setting; the later stages add it"
                echo "$setting" >"$RUNS/kernels-off"
            fi
            return 0
        fi
    done
    echo "preflight: no setting trained; the later stages run as asked"
}

check() {
    for dev in flex "$DEVICE"; do
        rm -rf "$RUNS/tiny-$dev"
        logged "$RUNS/tiny-$dev.log" \
            "$EMBER" train --config configs/tiny.toml --device "$dev" --out "$RUNS/tiny-$dev"
        grep -E "^(step .*val|done)" "$RUNS/tiny-$dev.log"
    done
    if [ "$DEVICE" = cuda ]; then
        # The same run with cubek's products in place of cuBLAS's and the fused attention kernels
        # in place of the attention's cuBLAS products (all TF32 but the fused kernels' plain f32):
        # the same initial weights and batches, so the losses differ only by rounding. A warning
        # line with "cuBLAS" (a failed start-up check) is printed below.
        rm -rf "$RUNS/tiny-cubek"
        EMBER_GPU_KERNELS=-cublas logged "$RUNS/tiny-cubek.log" \
            "$EMBER" train --config configs/tiny.toml --device cuda --out "$RUNS/tiny-cubek"
        echo "the cuda run again with cubek's products and the fused attention (EMBER_GPU_KERNELS=-cublas):"
        grep -E "^(step .*val|done)" "$RUNS/tiny-cubek.log"
        grep -i "cublas" "$RUNS/tiny-cuda.log" || true
        # That run's attention took ember's tensor-core kernels (TF32 fragments; heads of 16);
        # again on the GPU's ordinary cores (-attention-mma, plain f32): the same weights and
        # batches, so the losses differ by TF32's rounding alone. Then bf16 with dropout on the
        # tensor-core kernels (bf16 fragments; cuDNN's attention and the products off) beside
        # the bf16 runs below.
        rm -rf "$RUNS/tiny-cores"
        EMBER_GPU_KERNELS=-cublas,-attention-mma logged "$RUNS/tiny-cores.log" \
            "$EMBER" train --config configs/tiny.toml --device cuda --out "$RUNS/tiny-cores"
        echo "the same on the ordinary cores (EMBER_GPU_KERNELS=-cublas,-attention-mma):"
        grep -E "^(step .*val|done)" "$RUNS/tiny-cores.log"
        rm -rf "$RUNS/tiny-mma-bf16"
        EMBER_CUDNN_ATTENTION=0 EMBER_GPU_KERNELS=-attention-products logged "$RUNS/tiny-mma-bf16.log" \
            "$EMBER" train --config configs/tiny.toml --device cuda --out "$RUNS/tiny-mma-bf16" \
            --set 'training.precision="bf16"' --set model.dropout=0.1
        echo "bf16 with dropout, attention on ember's tensor-core kernels (EMBER_CUDNN_ATTENTION=0 EMBER_GPU_KERNELS=-attention-products):"
        grep -E "^(step .*val|done)" "$RUNS/tiny-mma-bf16.log"
        # Its evaluations (5 batches a split) replayed from a recording, cuBLAS's calls included
        # (the default), against every pass launched: the same weights and batches, so the same
        # validation losses but for the last digits.
        rm -rf "$RUNS/tiny-evals"
        EMBER_GPU_KERNELS=-eval-graph logged "$RUNS/tiny-evals.log" \
            "$EMBER" train --config configs/tiny.toml --device cuda --out "$RUNS/tiny-evals"
        echo "the cuda run again with every evaluation pass launched (EMBER_GPU_KERNELS=-eval-graph):"
        grep -E "^(step .*val|done)" "$RUNS/tiny-evals.log"
        # Mixed precision with dropout: the tiny config in bf16 on flex, on cuda, and on cuda
        # without the one-op mixed products and the asynchronous cuBLAS calls (the tracked casts
        # and waiting calls before them): near each other (each device its own initial weights
        # and masks, bf16 rounding), and the two cuda runs nearer still (the same weights and
        # masks; the one op rounds less). Without the weights' kept copies (-weight-copies) the
        # cuda run's lines equal the run with them (the copies hold the casts' values), but for
        # the last digits where cuDNN's backward pass sums the queries' gradients in another
        # order; a copy of the wrong weights would be off by what a step changes.
        local variant kernels
        for variant in flex:on cuda:on cuda:-weight-copies cuda:-mixed-products,-async-products; do
            dev=${variant%%:*} kernels=${variant#*:}
            rm -rf "$RUNS/tiny-bf16"
            EMBER_GPU_KERNELS=$(with_off "$kernels") logged "$RUNS/tiny-bf16-$dev.log" \
                "$EMBER" train --config configs/tiny.toml --device "$dev" --out "$RUNS/tiny-bf16" \
                --set 'training.precision="bf16"' --set model.dropout=0.1
            echo "bf16 with dropout on $dev (EMBER_GPU_KERNELS=$kernels):"
            grep -E "^(step .*val|done)" "$RUNS/tiny-bf16-$dev.log"
        done
        # Every warning and error line of those runs (a recorded evaluation refused or
        # disagreeing, a library call that failed), counted.
        echo "warning and error lines of the tiny runs:"
        cat "$RUNS"/tiny-*.log | grep -E "^(warning|error)" | sort | uniq -c || echo "  none"
    fi
    for dev in flex "$DEVICE"; do
        "$EMBER_GEN" generate --checkpoint "$RUNS/tiny-flex" --device "$dev" --prompt ROMEO: \
            --greedy --max-tokens 200 >"$RUNS/greedy-$dev.txt" 2>"$RUNS/greedy-$dev.log" || {
            echo "FAILED: generate on $dev"
            tail -5 "$RUNS/greedy-$dev.log"
            return 1
        }
    done
    # And on DEVICE without ember's GPU kernels (Burn's ops alone).
    EMBER_GPU_KERNELS=off "$EMBER_GEN" generate --checkpoint "$RUNS/tiny-flex" --device "$DEVICE" \
        --prompt ROMEO: --greedy --max-tokens 200 >"$RUNS/greedy-$DEVICE-off.txt" \
        2>"$RUNS/greedy-$DEVICE-off.log" || echo "FAILED: generate on $DEVICE without the kernels"
    for other in "$DEVICE" "$DEVICE-off"; do
        if cmp -s "$RUNS/greedy-flex.txt" "$RUNS/greedy-$other.txt"; then
            echo "greedy text from the flex checkpoint: identical on flex and $other (200 tokens)"
        else
            echo "greedy text from the flex checkpoint DIFFERS between flex and $other:"
            diff "$RUNS/greedy-flex.txt" "$RUNS/greedy-$other.txt" || true
        fi
    done
    # Temperature draws on DEVICE from replayed decoding steps (the default) and with every
    # step's kernels launched one by one: the same seed, the same text.
    for graph in on -step-graph; do
        EMBER_GPU_KERNELS=$graph "$EMBER_GEN" generate --checkpoint "$RUNS/tiny-flex" \
            --device "$DEVICE" --prompt ROMEO: --max-tokens 300 --seed 3 \
            >"$RUNS/drawn$graph.txt" 2>"$RUNS/drawn$graph.log" ||
            echo "FAILED: generate on $DEVICE with EMBER_GPU_KERNELS=$graph"
        tail -1 "$RUNS/drawn$graph.log"
    done
    # Compiled kernels are kept between runs (cubecl's store, `compilation.cache`): the second
    # of two identical runs compiles none (cubecl logs each compilation where CUBECL_DEBUG_LOG
    # names a file).
    local run compiled=()
    for run in 1 2; do
        rm -f "$RUNS/compiled-$run.log"
        # Steps launched one by one: cubecl's debug log records profiling events, which a
        # replayed step's capture cannot hold.
        EMBER_GPU_KERNELS=-step-graph CUBECL_DEBUG_LOG="$RUNS/compiled-$run.log" "$EMBER_GEN" generate --checkpoint \
            "$RUNS/tiny-flex" --device "$DEVICE" --prompt ROMEO: --max-tokens 20 --seed 4 \
            >"$RUNS/compiled-$run.out" 2>&1 || {
            echo "FAILED: generate on $DEVICE with CUBECL_DEBUG_LOG; its end:"
            tail -3 "$RUNS/compiled-$run.out"
        }
        compiled+=("$(grep -c START_KERNEL_COMPILATION "$RUNS/compiled-$run.log" 2>/dev/null || true)")
    done
    echo "kernels compiled by two identical runs on $DEVICE: ${compiled[0]:-?}, then ${compiled[1]:-?}" \
        "(0 the second time: compiled kernels are kept between runs)"
    if cmp -s "$RUNS/drawnon.txt" "$RUNS/drawn-step-graph.txt"; then
        echo "temperature draws on $DEVICE: identical replayed and step by step (300 tokens)"
    else
        echo "temperature draws on $DEVICE DIFFER between replayed and step-by-step decoding:"
        diff "$RUNS/drawnon.txt" "$RUNS/drawn-step-graph.txt" || true
    fi
}

speed() {
    # ember in f32 with its GPU kernels (ember-model's ops/cube) and without them (Burn's ops
    # alone), and with bf16 products (`training.precision = "bf16"`, kernels on), ROUNDS times
    # alternating; then PyTorch at the precision ember's f32 computes in (CUDA: f32 with TF32
    # tensor-core matmuls on sm80+; Vulkan: plain f32), eager and compiled, and in bf16 autocast
    # (ember's bf16 counterpart). A device without bf16 refuses that run in one line.
    rm -rf "$RUNS/speed"
    for round in $(seq "${ROUNDS:-1}"); do
        for run in ${SPEED_RUNS:-f32:on f32:-attention-products f32:-attention-products,-attention-tiles f32:-cublas bf16:on bf16:-attention-products bf16:-cublas}; do
            IFS=: read -r precision kernels split <<<"$run"
            split=${split:-auto}
            # The first run's checkpoint stays for sampling below (a later run may be refused:
            # bf16 on a device without it); the others share one folder.
            out="$RUNS/speed-other"
            [ -d "$RUNS/speed" ] || out="$RUNS/speed"
            rm -rf "$RUNS/speed-other"
            echo "round $round, precision $precision, EMBER_GPU_KERNELS=$kernels EMBER_SPLIT_K=$split"
            EMBER_GPU_KERNELS=$(with_off "$kernels") EMBER_SPLIT_K=$split logged "$RUNS/speed.log" "$EMBER" train --config "$CONFIG" \
                --device "$DEVICE" --out "$out" --stop-after "$STEPS" \
                --set "training.precision=\"$precision\"" || continue
            grep -E "^(peak|GPU memory|checkpoint:|warning|attention)" "$RUNS/speed.log"
            ms_per_step "$out"
        done
    done
    local p extra
    for p in ${SPEED_TORCH:-f32 f32-compile bf16}; do
        extra=()
        case $p in *-compile) extra=(--compile) p=${p%-compile} ;; esac
        [ "$p" = f32 ] && p=$(torch_f32)
        torch=("$PYTHON" scripts/torch_reference.py train --device "$TORCH_DEVICE" --d-model 384
            --heads 6 --layers 6 --context 256 --batch 64 --dropout 0.2 --steps "$STEPS"
            --precision "$p" "${extra[@]}")
        echo "\$ ${torch[*]}"
        with_gpu_peak "${torch[@]}" || echo "FAILED: PyTorch $p ${extra[*]}"
    done
    local gen_kernels=${GEN_KERNELS:-on -step-graph}
    for mode in "" "--no-cache"; do
        # With the KV cache, once per GEN_KERNELS setting (default: replayed steps, then every
        # step's kernels launched one by one); without it, the first setting only.
        for kernels in $gen_kernels; do
            [ -n "$mode" ] && [ "$kernels" != "${gen_kernels%% *}" ] && continue
            # Twice: the first run of a setting tunes and compiles its decoding shapes (on a
            # fresh machine 25-30 tokens/s where the second gave 217), the second is the figure.
            for run in first warm; do
                echo "EMBER_GPU_KERNELS=$kernels ($run run)"
                # shellcheck disable=SC2086 # $mode is empty or one flag
                EMBER_GPU_KERNELS=$(with_off "$kernels") logged "$RUNS/generate.log" "$EMBER_GEN" generate \
                    --checkpoint "$RUNS/speed" --device "$DEVICE" --prompt ROMEO: \
                    --max-tokens 500 --seed 1 $mode
                grep "tokens/s" "$RUNS/generate.log"
            done
        done
        # shellcheck disable=SC2086 # $mode is empty or one flag
        "$PYTHON" scripts/torch_reference.py generate --device "$TORCH_DEVICE" --d-model 384 \
            --heads 6 --layers 6 --context 256 --tokens 500 $mode
    done
}

full() {
    local entry seed kernels seeds=${FULL_SEEDS:-}
    for entry in ${seeds:-config}; do
        seed=${entry%%:*}
        kernels=${EMBER_GPU_KERNELS:-on}
        [ "$entry" = "$seed" ] || kernels=${entry#*:}
        rm -rf "$RUNS/full"
        local extra=()
        [ "$seed" = config ] || extra=(--set "training.seed=$seed")
        echo "seed: $seed, EMBER_GPU_KERNELS=$kernels"
        start=$(date +%s)
        [ -n "${FULL_STEPS:-}" ] && extra+=(--stop-after "$FULL_STEPS")
        EMBER_GPU_KERNELS=$(with_off "$kernels") logged "$RUNS/full.log" "$EMBER" train --config "$CONFIG" \
            --device "$DEVICE" --out "$RUNS/full" \
            --set "training.precision=\"${PRECISION:-f32}\"" "${extra[@]}"
        echo "wall: $(($(date +%s) - start)) s"
        grep -E "^(step .*val|done|peak|GPU memory|checkpoint:)" "$RUNS/full.log"
        ms_per_step "$RUNS/full"
    done
    "$EMBER_GEN" generate --checkpoint "$RUNS/full" --device "$DEVICE" --prompt ROMEO: --max-tokens 300 --seed 1
}

# Training as `torchrun --nproc-per-node 1` launches it: NCCL with world size 1 (the path taken:
# the start-up line), ms/step and the last logged losses against the same run without a
# launcher, alternating ROUNDS times, at PRECISION; then the collective's own time in the kernel
# profile of the last PROFILE_STEPS steps.
nccl() {
    local round run n=${PROFILE_STEPS:-10}
    echo "NCCL_PATH=${NCCL_PATH:-} (unset: the dynamic linker's search, then the toolkit and Python's wheels)"
    for round in $(seq "${ROUNDS:-1}"); do
        for run in plain launched; do
            echo "round $round: $run"
            nccl_train "$run" "$RUNS/nccl-$run" || continue
            grep -aE "^(peak|GPU memory|[0-9]+ process|step .*/.*loss)" "$RUNS/nccl.log" | tail -4
            ms_per_step "$RUNS/nccl-$run"
        done
    done
    for run in plain launched; do
        echo "kernel profile: $run"
        nccl_train "$run" "$RUNS/nccl-profile" --profile-steps "$n" || continue
        sed -n '/^kernel profile/,/^checkpoint:/p' "$RUNS/nccl.log" | grep -v '^checkpoint:' | head -30
    done
}

# One run of `nccl`: $1 `plain` (no launcher) or `launched` (torchrun's variables for one
# process), into the fresh folder $2, with more `ember train` arguments after; log in
# RUNS/nccl.log.
nccl_train() {
    local run=$1 out=$2 env=()
    shift 2
    [ "$run" = launched ] && env=(RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1
        MASTER_ADDR=127.0.0.1 MASTER_PORT="${MASTER_PORT:-29517}")
    rm -rf "$out"
    logged "$RUNS/nccl.log" env "${env[@]}" "$EMBER" train --config "$CONFIG" --device "$DEVICE" \
        --out "$out" --stop-after "$STEPS" --set "training.precision=\"${PRECISION:-f32}\"" "$@"
}

# What a first run costs: `ember generate` (500 tokens) in new processes, with nothing cached
# (cubecl's environment and the driver's ComputeCache moved aside), then with both caches (what
# the first left), with cubecl's alone and with the driver's alone; wall seconds of each
# process. The caches are put back afterwards. Needs a checkpoint (FIRST_CHECKPOINT, default
# the speed or nccl stage's).
firstrun() {
    local ckpt=${FIRST_CHECKPOINT:-}
    [ -n "$ckpt" ] || for ckpt in "$RUNS/speed" "$RUNS/nccl-plain" "$RUNS/full"; do
        [ -d "$ckpt" ] && break
    done
    [ -d "$ckpt" ] || { echo "firstrun: no checkpoint (run speed or nccl first)"; return 1; }
    local aside="$RUNS/caches-aside" nv="$HOME/.nv/ComputeCache" run t0
    rm -rf "$aside" && mkdir -p "$aside"
    [ -d target/environment ] && mv target/environment "$aside/environment"
    [ -d "$nv" ] && mv "$nv" "$aside/ComputeCache"
    for run in "nothing cached" "both caches" "cubecl's cache alone" "the driver's cache alone"; do
        case $run in
            "cubecl's cache alone") rm -rf "$nv" ;;
            "the driver's cache alone") rm -rf target/environment ;;
        esac
        t0=$(date +%s.%N)
        "$EMBER_GEN" generate --checkpoint "$ckpt" --device "$DEVICE" --prompt ROMEO: \
            --max-tokens 500 --seed 1 >"$RUNS/firstrun.log" 2>&1 || { tail -3 "$RUNS/firstrun.log"; continue; }
        echo "$run: $("$PYTHON" -c "print(round($(date +%s.%N) - $t0, 2))") s wall; $(grep -o '[0-9.]* tokens/s' "$RUNS/firstrun.log" | head -1)"
    done
    rm -rf target/environment "$nv"
    [ -d "$aside/environment" ] && mv "$aside/environment" target/environment
    [ -d "$aside/ComputeCache" ] && mkdir -p "$HOME/.nv" && mv "$aside/ComputeCache" "$nv"
    rm -rf "$aside"
}

# ember's kernel profile of the last PROFILE_STEPS of STEPS steps (`ember train --profile-steps`)
# at each of PROFILE_PRECISIONS (default `f32 bf16`), then PyTorch's (torch.profiler) at the same
# precisions. PROFILE_MODEL=gpt2 profiles GPT-2 124M's body as `gpt2` trains it (12 x 768, 12
# heads, context 1024, batch 16; ember with its default attention, cuDNN's where it is found)
# instead of nanoGPT's GPU config.
profile() {
    local n=${PROFILE_STEPS:-10} size=() torch_size=(--d-model 384 --heads 6 --layers 6
        --context 256 --batch 64)
    if [ "${PROFILE_MODEL:-}" = gpt2 ]; then
        size=("${GPT2_SIZE[@]}")
        torch_size=("${GPT2_TORCH_SIZE[@]}")
    fi
    for precision in ${PROFILE_PRECISIONS:-f32 bf16}; do
        echo "ember profile, ${PROFILE_MODEL:-nanogpt}, precision $precision"
        rm -rf "$RUNS/profile"
        logged "$RUNS/profile.log" "$EMBER" train --config "$CONFIG" --device "$DEVICE" \
            --out "$RUNS/profile" --stop-after "$STEPS" --profile-steps "$n" --no-checkpoints \
            "${size[@]}" --set "training.precision=\"$precision\"" || continue
        sed -n '/^kernel profile/,/^checkpoint:/p' "$RUNS/profile.log" | grep -v '^checkpoint:'
        grep -E "^(peak|attention)" "$RUNS/profile.log"
    done
    for p in ${PROFILE_PRECISIONS:-f32 bf16}; do
        [ "$p" = f32 ] && p=$(torch_f32)
        torch=("$PYTHON" scripts/torch_reference.py train --device "$TORCH_DEVICE" "${torch_size[@]}"
            --dropout 0.2 --steps 20 --warmup 10 --precision "$p" --profile "$n")
        echo "\$ ${torch[*]}"
        "${torch[@]}" || echo "FAILED: PyTorch profile, $p"
    done
}

# What limits the attention kernels, by Nsight Compute (`ncu`, where the CUDA toolkit has it):
# each kernel of one training step (the third: KERNEL_SKIP launches skipped, default 48, the two
# steps before at 24 attention launches each for 6 layers), then the same for PyTorch's
# attention kernels in its bf16 and TF32 steps. Per kernel: its time, the SM's and memory's
# share of their peaks, the busiest memory pipe (shared memory included), issue slots, the
# occupancy and registers, and the warps' stall reasons, from ncu's sections. KERNELS is the
# kernel-name regex (default `attention`: ember's training kernels); the full reports go to
# RUNS/kernels-*.txt. TORCH_KERNELS the PyTorch precisions profiled (default `bf16 tf32`; empty:
# ember's kernels alone). Only for DEVICE=cuda.
kernels() {
    local ncu sections summary
    ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /usr/local/cuda-*/bin/ncu \
        /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1) || true
    if [ -z "$ncu" ] || [ "${DEVICE%%:*}" != cuda ]; then
        echo "kernels: needs ncu (Nsight Compute) and DEVICE=cuda; skipped"
        return 0
    fi
    sections=(--section SpeedOfLight --section ComputeWorkloadAnalysis
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats
        --section WarpStateStats --section InstructionStats)
    # The lines that say what limits a kernel, with its name.
    summary='^  [a-zA-Z_][a-zA-Z0-9_]* \(|^  void |Duration|Compute \(SM\) Throughput|Memory Throughput|Max Bandwidth|L1/TEX Hit|Issue Slots Busy|Executed Ipc A|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Warp Cycles Per Issued|Dynamic Shared|Static Shared|stall|Stall|bank'
    rm -rf "$RUNS/kernels"
    echo "\$ $ncu --kernel-name regex:${KERNELS:-attention} ... $EMBER train (3 steps)"
    "$ncu" "${sections[@]}" --kernel-name "regex:${KERNELS:-attention}" \
        --launch-skip "${KERNEL_SKIP:-48}" --launch-count "${KERNEL_COUNT:-24}" \
        "$EMBER" train --config "$CONFIG" --device "$DEVICE" --out "$RUNS/kernels" \
        --stop-after 3 >"$RUNS/kernels-ember.txt" 2>&1 || echo "FAILED: ncu of ember"
    grep -E "$summary" "$RUNS/kernels-ember.txt" | cut -c1-150 | head -400
    for p in ${TORCH_KERNELS-bf16 tf32}; do
        echo "\$ $ncu --kernel-name regex:flash|fmha|attn ... torch_reference.py train ($p)"
        "$ncu" "${sections[@]}" --kernel-name "regex:flash|fmha|attn|Attention" \
            --launch-skip 24 --launch-count 12 \
            "$PYTHON" scripts/torch_reference.py train --device "$TORCH_DEVICE" --d-model 384 \
            --heads 6 --layers 6 --context 256 --batch 64 --dropout 0.2 --steps 4 --warmup 2 \
            --precision "$p" >"$RUNS/kernels-torch-$p.txt" 2>&1 || echo "FAILED: ncu of PyTorch"
        grep -E "$summary" "$RUNS/kernels-torch-$p.txt" | cut -c1-150 | head -150
    done
}

# What STEPS_MEMORY steps (default 10) hold on the device, three ways: the most bytes ember's
# tensors held at once and the most its pools reserved (cubecl's memory log, read by
# scripts/memory-log.py: PyTorch's max_memory_allocated and max_memory_reserved), ember's own
# `GPU memory` line (live bytes before a backward pass), and the process by nvidia-smi; then
# PyTorch's run with its two figures. The run starts in its own folder, where a cubecl.toml
# turns the memory log on (the log slows the run: its times are not speeds).
memory() {
    # Each of MEMORY_RUNS (default `on:enabled on:size-match -attention-products:enabled`), as
    # EMBER_GPU_KERNELS:cubecl's persistent_memory setting (`size-match` serves allocations of a
    # weight's size, the recurring ones of training, from exact-sized pools), then PyTorch.
    local root dir run kernels pools
    root=$(pwd)
    absolute() { case $1 in /*) echo "$1" ;; *) echo "$root/$1" ;; esac }
    for run in ${MEMORY_RUNS:-on:enabled on:size-match -attention-products:enabled}; do
        IFS=: read -r kernels pools <<<"$run"
        echo "== memory: EMBER_GPU_KERNELS=$kernels, persistent_memory=${pools:-enabled}"
        dir="$RUNS/memory"
        rm -rf "$dir"
        mkdir -p "$dir"
        # The config's data paths are relative to the repository.
        ln -s "$root/data" "$dir/data"
        printf '[memory]\npersistent_memory = "%s"\n\n[memory.logger]\nlevel = "full"\nfile = "cubecl-memory.log"\n' \
            "${pools:-enabled}" >"$dir/cubecl.toml"
        (
            cd "$dir"
            EMBER_GPU_KERNELS=$(with_off "$kernels") logged train.log "$(absolute "$EMBER")" train \
                --config "$(absolute "$CONFIG")" --device "$DEVICE" --out run \
                --stop-after "${STEPS_MEMORY:-10}" --set "training.precision=\"${PRECISION:-f32}\""
            grep -E "^(peak|GPU memory)" train.log
            "$PYTHON" "$root/scripts/memory-log.py" cubecl-memory.log
        ) || echo "FAILED: memory run $run"
    done
    precision=$(torch_f32)
    [ "${PRECISION:-f32}" = bf16 ] && precision=bf16
    torch=("$PYTHON" scripts/torch_reference.py train --device "$TORCH_DEVICE" --d-model 384
        --heads 6 --layers 6 --context 256 --batch 64 --dropout 0.2 --steps "${STEPS_MEMORY:-10}"
        --precision "$precision")
    echo "\$ ${torch[*]}"
    with_gpu_peak "${torch[@]}" || echo "FAILED: PyTorch $precision"
}

# The PyTorch reference of `full`: the GPU config's 5000 iterations (fp32 eager, as `speed`
# times), its time and val loss on the same GPU.
reference() {
    torch=("$PYTHON" scripts/torch_reference.py quality --device "$TORCH_DEVICE" --d-model 384
        --heads 6 --layers 6 --context 256 --batch 64 --dropout 0.2 --steps 5000
        --eval-batches 200)
    echo "\$ ${torch[*]}"
    with_gpu_peak "${torch[@]}"
}

# Where the host's time goes while ember samples 500 tokens with its KV cache on DEVICE, from
# the `speed` stage's checkpoint (else a 10-step run): batch-1 sampling on a GPU is bound by the
# host's cost per kernel launch (docs/benchmarks.md). Prints the CPU time of each of the
# process's threads against the wall time (from /proc, polled every 0.2 s): the caller building
# Burn's ops, cubecl's device thread (`DSD-...`) launching them, the driver's threads. A thread
# near 100% of the wall time is the bound. Where `perf` works (not on gVisor), also each thread's
# hottest symbols.
host() {
    local run="$RUNS/speed"
    if [ ! -d "$run" ] && [ "${HOST_RUN:-}" != train ]; then
        run="$RUNS/host-run"
        rm -rf "$run"
        logged "$RUNS/host-train.log" "$EMBER" train --config "$CONFIG" --device "$DEVICE" \
            --out "$run" --stop-after 10 || return 1
    fi
    local perf=()
    if command -v perf >/dev/null && perf record -o /dev/null -- true >/dev/null 2>&1; then
        perf=(perf record -F 2999 -o "$RUNS/host.perf" --)
    else
        echo "host: no working perf here; thread times only"
    fi
    local pass pid start snapshot last tick target wall prefix
    tick=$(getconf CLK_TCK)
    # HOST_RUN=train: HOST_STEPS training steps (default 300, no evaluation) instead of a
    # sample: a main thread whose CPU seconds come near the wall time is what bounds the step
    # (launches, autodiff, the blocking calls into CubeCL's device thread for cuBLAS and cuDNN).
    local binary=$EMBER_GEN
    [ "${HOST_RUN:-}" = train ] && binary=$EMBER
    for pass in warm-up recorded; do
        prefix=()
        [ "$pass" = recorded ] && prefix=("${perf[@]}")
        start=$(date +%s.%N)
        if [ "${HOST_RUN:-}" = train ]; then
            rm -rf "$RUNS/host-train"
            "${prefix[@]}" "$EMBER" train --config "$CONFIG" --device "$DEVICE" \
                --out "$RUNS/host-train" --stop-after "${HOST_STEPS:-300}" \
                --set "training.precision=\"${PRECISION:-f32}\"" \
                --set training.eval_interval=100000 --set training.log_interval=50 \
                >/dev/null 2>"$RUNS/host.log" &
        else
            "${prefix[@]}" "$EMBER_GEN" generate --checkpoint "$run" --device "$DEVICE" \
                --prompt ROMEO: --max-tokens 500 --seed 1 >/dev/null 2>"$RUNS/host.log" &
        fi
        pid=$!
        last=""
        while kill -0 "$pid" 2>/dev/null; do
            # Under perf, the sampled process is perf's child (and perf outlives it).
            target=$pid
            if [ ${#prefix[@]} -gt 0 ]; then
                target=$(pgrep -P "$pid" -x "$(basename "$binary")") || target=""
            fi
            snapshot=""
            [ -n "$target" ] && snapshot=$(thread_times "$target" "$tick")
            [ -n "$snapshot" ] && last=$snapshot
            sleep 0.2
        done
        wait "$pid" || {
            echo "FAILED: generate ($pass)"
            tail -5 "$RUNS/host.log"
            return 1
        }
        wall=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')
        local rate
        case "${HOST_RUN:-}" in
        train) rate=$(grep -oE '[0-9.]+ ms/step' "$RUNS/host.log" | tail -1) ;;
        *) rate=$(grep -oE '[0-9]+ tokens/s' "$RUNS/host.log" | tail -1) ;;
        esac
        echo "$pass: $rate, $wall s wall with start-up;" \
            "CPU seconds by thread (the last reading, up to 0.2 s before the end):"
        echo "$last" | sort -k2 -nr | head -8 | sed 's/^/    /'
    done
    if [ ${#perf[@]} -gt 0 ]; then
        perf report -i "$RUNS/host.perf" --sort comm,dso --stdio 2>/dev/null | grep -v '^#' | grep . | head -12
        perf report -i "$RUNS/host.perf" --sort comm,sym --stdio 2>/dev/null | grep -v '^#' | grep . | head -40
    fi
}

# Prints "name cpu-seconds" for each thread of process $1 (user + system, from /proc), $2 the
# clock ticks per second.
thread_times() {
    local pid=$1 tick=$2 task stat name
    for task in /proc/"$pid"/task/*; do
        stat=$(cat "$task/stat" 2>/dev/null) || continue
        name=${stat#*(}
        name=${name%)*}
        # After the name: state, ppid, ... utime (the 12th), stime (the 13th).
        echo "${stat##*) }" | awk -v name="${name// /_}" -v tick="$tick" \
            '{ printf "%s %.2f\n", name, ($12 + $13) / tick }'
    done
}

# cuDNN's flash attention on DEVICE=cuda: which cuDNN PyTorch's environment brings (ember finds
# the same `nvidia/cudnn/lib` through the `python3` on PATH, or CUDNN_PATH), ember's start-up
# check of it against its own kernels (the `attention:` line: output, log-sum-exps and gradient,
# and the dropout masks of both passes), and a short bf16 run of the GPU config with cuDNN's own
# error log on (CUDNN_LOGERR_DBG), the first lines of which are printed where it says anything.
# Where OUT is set (the GPU machine's folder that comes back), the check's inputs and outputs
# are also written in full to $OUT/cudnn-dump (EMBER_CUDNN_DUMP; raw f32 files, cases.txt).
cudnn() {
    "$PYTHON" -c 'import torch; print("PyTorch", torch.__version__, "runs cuDNN", torch.backends.cudnn.version())' || true
    echo "CUDNN_PATH=${CUDNN_PATH:-} (unset: the system's cuDNN, else PyTorch's)"
    rm -rf "$RUNS/cudnn"
    EMBER_CUDNN_DUMP=${EMBER_CUDNN_DUMP:-${OUT:+$OUT/cudnn-dump}} \
        EMBER_CUDNN_ATTENTION=1 EMBER_CUDNN_CHECK=${EMBER_CUDNN_CHECK:-report} CUDNN_LOGERR_DBG=1 CUDNN_LOGDEST_DBG=stderr logged "$RUNS/cudnn.log" "$EMBER" train \
        --config "$CONFIG" --device "$DEVICE" --out "$RUNS/cudnn" --stop-after "${CUDNN_STEPS:-40}" \
        --set 'training.precision="bf16"' --set training.log_interval=10 || true
    grep -E "^(attention|warning|peak|GPU memory|cuDNN check|    )" "$RUNS/cudnn.log" || true
    grep -iE "cudnn|error" "$RUNS/cudnn.log" | grep -vE "^(attention|warning)" | head -20 || true
    [ -f "$RUNS/cudnn/metrics.jsonl" ] && ms_per_step "$RUNS/cudnn"
}

# GPT-2 124M's body (12 layers of 768, 12 heads, context 1024, batch 16; the GPU config's
# character vocabulary, dropout and optimizer) in ember and PyTorch eager, GPT2_STEPS steps each
# (default 40): GPT2_RUNS are ember's runs, each PRECISION:EMBER_GPU_KERNELS[:cudnn] (default
# `bf16:on:cudnn bf16:on f32:on`: cuDNN's flash attention (EMBER_CUDNN_ATTENTION=1), the
# attention's paths timed and the fastest kept (`attention-tune`), f32 with TF32;
# `f32:-attention-tune` runs the attention as products, `f32:-attention-products,-attention-tune`
# on ember's tensor-core kernels, `f32:-attention-products,-attention-mma` on the ordinary cores),
# GPT2_TORCH PyTorch's precisions (default `bf16 tf32`; `f32` is TF32 on CUDA, `bf16-compile`
# adds torch.compile). ember's runs write no checkpoint (`--no-checkpoints`: a GPT-2-sized one
# is about 1 GB), here and in `paths`.
gpt2() {
    local size=("${GPT2_SIZE[@]}" --set training.log_interval=5)
    local run precision kernels cudnn
    for run in ${GPT2_RUNS:-bf16:on:cudnn bf16:on f32:on}; do
        IFS=: read -r precision kernels cudnn <<<"$run"
        echo "GPT-2 body, ember, precision $precision, EMBER_GPU_KERNELS=$kernels${cudnn:+, with cuDNN flash attention}"
        rm -rf "$RUNS/gpt2"
        EMBER_CUDNN_ATTENTION=$([ -n "$cudnn" ] && echo 1 || echo 0) EMBER_GPU_KERNELS=$(with_off "$kernels") logged "$RUNS/gpt2.log" "$EMBER" train --config "$CONFIG" \
            --device "$DEVICE" --out "$RUNS/gpt2" --stop-after "${GPT2_STEPS:-40}" --no-checkpoints "${size[@]}" \
            --set "training.precision=\"$precision\"" || continue
        grep -E "^(attention|warning|peak|GPU memory)" "$RUNS/gpt2.log" || true
        ms_per_step "$RUNS/gpt2"
    done
    local p extra
    for p in ${GPT2_TORCH:-bf16 tf32}; do
        extra=()
        case $p in *-compile) extra=(--compile) p=${p%-compile} ;; esac
        # ember's f32 is TF32 on CUDA (as in `speed`).
        [ "$p" = f32 ] && p=$(torch_f32)
        torch=("$PYTHON" scripts/torch_reference.py train --device "$TORCH_DEVICE"
            "${GPT2_TORCH_SIZE[@]}" --dropout 0.2
            --steps "${GPT2_STEPS:-40}" --precision "$p" "${extra[@]}")
        echo "\$ ${torch[*]}"
        with_gpu_peak "${torch[@]}" || echo "FAILED: PyTorch GPT-2 body, $p"
    done
}

# The training attention's paths timed against each other on DEVICE (`attention-tune`'s lines:
# the batched products, the tensor-core kernels at each plan, the fused kernels, each pass's
# time and the one kept): one step of GPT-2's body (12 x 768, 12 heads) at each context of
# PATHS_CONTEXTS (default `1024 256 512 2048`; 16384 positions a batch) and of nanoGPT's GPU
# config, at each of PATHS_PRECISIONS (default `f32 bf16`: TF32 on CUDA, and bf16 without
# cuDNN's attention, EMBER_CUDNN_ATTENTION=0), with the config's dropout.
paths() {
    local precision context size
    for precision in ${PATHS_PRECISIONS:-f32 bf16}; do
        for context in ${PATHS_CONTEXTS:-1024 256 512 2048} nanogpt; do
            size=()
            [ "$context" = nanogpt ] || size=(--set model.d_model=768 --set model.n_heads=12
                --set model.n_layers=12 --set "model.context_len=$context"
                --set "training.batch_size=$((16384 / context))")
            echo "attention paths, $precision, context $context"
            rm -rf "$RUNS/paths"
            EMBER_CUDNN_ATTENTION=0 logged "$RUNS/paths.log" "$EMBER" train --config "$CONFIG" \
                --device "$DEVICE" --out "$RUNS/paths" --stop-after 1 --no-checkpoints "${size[@]}" \
                --set "training.precision=\"$precision\"" || continue
            grep -E "^(attention|warning)" "$RUNS/paths.log" || echo "  (no pass timed)"
        done
    done
}

# Every stage within BUDGET seconds (default 550): speed, check, profile and memory, each
# stopped at its own cap (300, 90, 110, 70 s) if it runs long, then `full` until the budget is
# spent (its validation losses so far are printed when it is stopped). Each stage's output also
# goes to LOGS/<stage>.log (default RUNS/stages). A stopped stage's processes are ended before
# the next.
# Translation: configs/multi30k-de-en-2h.toml (7.6M parameters, batches of at most 4096
# padded tokens) for MT_EPOCHS epochs (default 1) after a first one (in which a GPU compiles
# and tunes its kernels for each bucketed shape), ember on DEVICE at each of MT_RUNS
# (PRECISION:EMBER_GPU_KERNELS, default `f32:on bf16:on`) and PyTorch eager on the same batches
# at each of MT_TORCH (default `tf32 bf16`; scripts/torch_translation.py): target tokens per
# second over the timed epochs, as `ember train` counts them. Evaluations off. MT_PAIRS: the
# first that many training pairs only (a quick try on a CPU: DEVICE=flex MT_PAIRS=2000).
mt() {
    local config=configs/multi30k-de-en-2h.toml epochs=${MT_EPOCHS:-1}
    local quiet=(--set training.eval_interval=1000000 --set data.bleu_sentences=0
        --set training.checkpoint_interval=1000000) pairs=()
    if [ -n "${MT_PAIRS:-}" ]; then
        quiet+=(--set "data.max_train_pairs=$MT_PAIRS")
        pairs=(--max-pairs "$MT_PAIRS")
    fi
    # One step on the CPU for the run's BPE (trained at the start of every run, the same each
    # time) and the epoch's batches and target tokens.
    rm -rf "$RUNS/mt"
    logged "$RUNS/mt.log" "$EMBER" train --config "$config" --device flex --out "$RUNS/mt" \
        --stop-after 1 "${quiet[@]}" || return 1
    local batches tokens
    batches=$(sed -nE 's/^batches: ([0-9]+) a training epoch.*/\1/p' "$RUNS/mt.log")
    tokens=$(sed -nE 's/^batches: .*\(([0-9]+) target tokens\)/\1/p' "$RUNS/mt.log")
    cp "$(ls "$RUNS"/mt/checkpoints/*/tokenizer.json | head -1)" "$RUNS/mt-tokenizer.json"
    echo "an epoch: $batches batches, $tokens target tokens"
    local run precision kernels
    for run in ${MT_RUNS:-f32:on bf16:on}; do
        IFS=: read -r precision kernels <<<"$run"
        echo "translation, ember, precision $precision, EMBER_GPU_KERNELS=$kernels"
        rm -rf "$RUNS/mt"
        EMBER_GPU_KERNELS=$(with_off "$kernels") logged "$RUNS/mt.log" "$EMBER" train --config "$config" \
            --device "$DEVICE" --out "$RUNS/mt" --stop-after $((batches * (epochs + 1))) \
            --set training.log_interval="$batches" --set "training.precision=\"$precision\"" \
            "${quiet[@]}" || continue
        grep -E "^(warning|done|peak|GPU memory)" "$RUNS/mt.log" || true
        "$PYTHON" - "$RUNS/mt/metrics.jsonl" "$batches" "$tokens" <<'EOF'
import json, sys
logs = [json.loads(l) for l in open(sys.argv[1]) if '"kind":"log"' in l]
batches, tokens = int(sys.argv[2]), int(sys.argv[3])
first, last = logs[0], logs[-1]
epochs = (last["step"] - first["step"]) // batches
seconds = last["elapsed_secs"] - first["elapsed_secs"]
print(f"ember: {epochs} epoch(s) after the first in {seconds:.1f} s: "
      f"{epochs * tokens / seconds:.0f} target tokens/s, "
      f"{1000 * seconds / (epochs * batches):.1f} ms/step "
      f"(the first epoch {first['elapsed_secs']:.1f} s)")
EOF
    done
    local p torch
    for p in ${MT_TORCH:-tf32 bf16}; do
        torch=("$PYTHON" scripts/torch_translation.py --tokenizer "$RUNS/mt-tokenizer.json"
            --device "$TORCH_DEVICE" --precision "$p" --epochs "$epochs" "${pairs[@]}")
        echo "\$ ${torch[*]}"
        with_gpu_peak "${torch[@]}" || echo "FAILED: PyTorch translation, $p"
    done
}

all() {
    local t0 deadline left stage cap logs=${LOGS:-$RUNS/stages}
    t0=$(date +%s)
    deadline=$((t0 + ${BUDGET:-550}))
    mkdir -p "$logs"
    # An earlier run's log would read as this one's when `full` is skipped. An earlier
    # preflight's finding stays for a call without a preflight of its own (the same machine).
    rm -f "$RUNS/full.log"
    case " ${STAGES:-} " in *" preflight"*) rm -f "$RUNS/kernels-off" ;; esac
    local device name
    for stage in ${STAGES:-speed:300 check:90 profile:110 memory:70 full:100000}; do
        cap=${stage##*:} stage=${stage%:*}
        device=$DEVICE
        case $stage in *@*) device=${stage#*@} stage=${stage%%@*} ;; esac
        name=$stage
        [ "$device" = "$DEVICE" ] || name="$stage-$device"
        left=$((deadline - $(date +%s)))
        if [ "$left" -lt 20 ]; then
            echo "== $name skipped: ${left} s left"
            continue
        fi
        [ "$cap" -gt "$left" ] && cap=$left
        echo "== $stage on $device (at $(($(date +%s) - t0)) s, at most $cap s)"
        # Each device keeps its own runs, so `speed` on one does not remove another's checkpoint.
        local runs=$RUNS
        [ "$device" = "$DEVICE" ] || runs="$RUNS/$device"
        # What `preflight` found the default path needs turned off, for every stage after it.
        KERNELS_OFF=$(cat "$RUNS/kernels-off" 2>/dev/null || true)
        [ -n "$KERNELS_OFF" ] && echo "   (EMBER_GPU_KERNELS gains $KERNELS_OFF: preflight)"
        # Runs that set no EMBER_GPU_KERNELS of their own inherit it.
        KERNELS_OFF=$KERNELS_OFF EMBER_GPU_KERNELS=$(KERNELS_OFF=$KERNELS_OFF with_off "${EMBER_GPU_KERNELS:-}") \
            DEVICE=$device RUNS=$runs timeout -k 5 "$cap" bash scripts/bench-gpu.sh "$stage" 2>&1 |
            tee "$logs/$name.log" || true
        # `timeout` stops the stage's shell; its ember or PyTorch child may still run.
        pkill -9 -x "$(basename "$EMBER")" 2>/dev/null || true
        pkill -9 -f "scripts/torch_(reference|translation).py" 2>/dev/null || true
    done
    if [ -f "$RUNS/full.log" ] && ! grep -q "^done" "$RUNS/full.log"; then
        echo "full stopped by the budget; its evaluations so far:"
        grep -E "^step .*val" "$RUNS/full.log" || true
    fi
    if [ -n "${OUT:-}" ] && [ -d target/environment ]; then
        # With the driver's cache of what it compiled from CubeCL's PTX, where it is small
        # enough to carry: without it a new machine compiles every kernel again at first load.
        local driver=()
        if [ -d "$HOME/.nv/ComputeCache" ] &&
            [ "$(du -sm "$HOME/.nv/ComputeCache" | cut -f1)" -lt 40 ]; then
            driver=(-C "$HOME" .nv/ComputeCache)
        fi
        tar -cJf "$OUT/environment.tar.xz" target/environment "${driver[@]}" &&
            echo "cubecl environment for the next run: $OUT/environment.tar.xz (ENV_ARCHIVE${driver:+, with the kernels the driver compiled})"
    fi
    echo "all: $(($(date +%s) - t0)) s"
}

command -v nvidia-smi >/dev/null &&
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"${1:?usage: bench-gpu.sh preflight|check|speed|full|profile|memory|host|kernels|reference|cudnn|gpt2|paths|mt|nccl|firstrun|all}"
