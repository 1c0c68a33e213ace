#!/usr/bin/env bash
# ember against PyTorch eager on the same machine, in one run, alternating: training steps of
# nanoGPT's CPU "baby GPT" (configs/shakespeare-char.toml sizes) and batch-1 generation with and
# without a KV cache. ember trains twice: on one device, and data-parallel over two CPU workers
# (`device = "flex,flex"`, batch 6 x grad_accum 2: the same 12 sequences per step). Prints each
# measurement, the medians and the ratios (ember / PyTorch, higher is better for ember).
# Not part of CI.
#
#   bash scripts/bench-compare.sh                    # 3 rounds of 100 training steps
#   ROUNDS=5 STEPS=200 THREADS=2 bash scripts/bench-compare.sh
#   AGAINST=/path/to/older/ember bash scripts/bench-compare.sh   # ember against another build
#
# Needs PyTorch: python3 -m venv .venv && .venv/bin/pip install torch  (PYTHON=.venv/bin/python).
# With AGAINST, another ember binary (e.g. an earlier commit's) takes PyTorch's place: it trains
# the same config, generates from this build's checkpoint, and each round checks that both
# builds reach the same validation loss and generate the same text.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-100}
TOKENS=${TOKENS:-500}
THREADS=${THREADS:-2}
PYTHON=${PYTHON:-python3}
AGAINST=${AGAINST:-}
EMBER=./target/release/ember
REF=pytorch; [ -n "$AGAINST" ] && REF=baseline
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

cargo build --release --workspace --locked 2>&1 | tail -1
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
if [ -n "$AGAINST" ]; then
    echo "against: $AGAINST, threads $THREADS"
else
    echo "torch: $($PYTHON -c 'import torch; print(torch.__version__)'), threads $THREADS"
fi
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"

# The baby config, shortened, evaluating and checkpointing only at the end.
sed -e "s/^max_steps = .*/max_steps = $STEPS/" -e "s/^decay_steps = .*/decay_steps = $STEPS/" \
    -e "s/^eval_interval = .*/eval_interval = $STEPS/" -e "s/^eval_batches = .*/eval_batches = 1/" \
    -e "s/^checkpoint_interval = .*/checkpoint_interval = $STEPS/" \
    configs/shakespeare-char.toml > "$WORK/baby.toml"
sed -e 's/^batch_size = 12$/batch_size = 6\ngrad_accum = 2\ndevice = "flex,flex"/' \
    "$WORK/baby.toml" > "$WORK/baby-dp.toml"
grep -q 'flex,flex' "$WORK/baby-dp.toml" || { echo "could not make the data-parallel config"; exit 1; }

median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
: > "$WORK/e_train"; : > "$WORK/e_train_dp"; : > "$WORK/t_train"
for mode in cache nocache; do : > "$WORK/e_$mode"; : > "$WORK/t_$mode"; done

for round in $(seq "$ROUNDS"); do
    echo "== round $round"
    rm -rf "$WORK/run"
    cmd="$EMBER train --config $WORK/baby.toml --out $WORK/run"
    RAYON_NUM_THREADS=$THREADS $cmd > "$WORK/train.log" 2>&1
    ms=$(sed -n 's/.*(\([0-9.]*\) ms\/step.*/\1/p' "$WORK/train.log")
    echo "ember   train: $ms ms/step   ($cmd)"; echo "$ms" >> "$WORK/e_train"
    rm -rf "$WORK/run-dp"
    cmd="$EMBER train --config $WORK/baby-dp.toml --out $WORK/run-dp"
    ms=$(RAYON_NUM_THREADS=$THREADS $cmd 2>&1 | sed -n 's/.*(\([0-9.]*\) ms\/step.*/\1/p')
    echo "ember   train, flex,flex: $ms ms/step   ($cmd)"; echo "$ms" >> "$WORK/e_train_dp"

    if [ -n "$AGAINST" ]; then
        rm -rf "$WORK/run-ref"
        cmd="$AGAINST train --config $WORK/baby.toml --out $WORK/run-ref"
        out=$(RAYON_NUM_THREADS=$THREADS $cmd 2>&1)
        ms=$(echo "$out" | sed -n 's/.*(\([0-9.]*\) ms\/step.*/\1/p')
        echo "baseline train: $ms ms/step   ($cmd)"; echo "$ms" >> "$WORK/t_train"
        # Same config, same seed: the same validation loss to the printed digit.
        ours=$(sed -n 's/^done: .*val loss \([0-9.]*\).*/\1/p' "$WORK/train.log")
        theirs=$(echo "$out" | sed -n 's/^done: .*val loss \([0-9.]*\).*/\1/p')
        [ "$ours" = "$theirs" ] || { echo "val loss differs: $ours against $theirs"; exit 1; }
    else
        cmd="$PYTHON scripts/torch_reference.py train --steps $STEPS --threads $THREADS"
        ms=$($cmd | $PYTHON -c 'import json,sys; print(json.load(sys.stdin)["ms_per_step_median"])')
        echo "pytorch train: $ms ms/step   ($cmd)"; echo "$ms" >> "$WORK/t_train"
    fi

    for mode in cache nocache; do
        flag=""; [ "$mode" = nocache ] && flag="--no-cache"
        cmd="$EMBER generate --checkpoint $WORK/run --prompt ROMEO: --max-tokens $TOKENS --seed 1 $flag"
        tps=$(RAYON_NUM_THREADS=$THREADS $cmd 2>&1 >"$WORK/text-ours" | sed -n 's/.*(\([0-9.]*\) tokens\/s.*/\1/p')
        echo "ember   generate ($mode): $tps tokens/s   ($cmd)"; echo "$tps" >> "$WORK/e_$mode"
        if [ -n "$AGAINST" ]; then
            cmd="$AGAINST generate --checkpoint $WORK/run --prompt ROMEO: --max-tokens $TOKENS --seed 1 $flag"
            tps=$(RAYON_NUM_THREADS=$THREADS $cmd 2>&1 > "$WORK/text-theirs" | sed -n 's/.*(\([0-9.]*\) tokens\/s.*/\1/p')
            echo "baseline generate ($mode): $tps tokens/s   ($cmd)"; echo "$tps" >> "$WORK/t_$mode"
            cmp -s "$WORK/text-ours" "$WORK/text-theirs" || { echo "the generated texts differ"; exit 1; }
        else
            cmd="$PYTHON scripts/torch_reference.py generate --tokens $TOKENS --threads $THREADS $flag"
            tps=$($cmd | $PYTHON -c 'import json,sys; print(json.load(sys.stdin)["tokens_per_sec"])')
            echo "pytorch generate ($mode): $tps tokens/s   ($cmd)"; echo "$tps" >> "$WORK/t_$mode"
        fi
    done
done

echo "== medians over $ROUNDS rounds"
tokens=$((12 * 64))
et=$(median < "$WORK/e_train"); tt=$(median < "$WORK/t_train")
awk -v e="$et" -v t="$tt" -v n="$tokens" -v r="$REF" 'BEGIN {
    printf "train     ember %7.1f ms/step (%6.0f tok/s)  %s %7.1f ms/step (%6.0f tok/s)  ember/%s speed %.2f\n",
        e, n / e * 1000, r, t, n / t * 1000, r, t / e }'
ed=$(median < "$WORK/e_train_dp")
awk -v e="$ed" -v t="$tt" -v n="$tokens" -v r="$REF" 'BEGIN {
    printf "train, ember on flex,flex %7.1f ms/step (%6.0f tok/s)  ember/%s speed %.2f\n",
        e, n / e * 1000, r, t / e }'
for mode in cache nocache; do
    e=$(median < "$WORK/e_$mode"); t=$(median < "$WORK/t_$mode")
    awk -v e="$e" -v t="$t" -v m="$mode" -v r="$REF" 'BEGIN {
        printf "generate  %-8s ember %7.0f tok/s  %s %7.0f tok/s  ember/%s speed %.2f\n", m, e, r, t, r, e / t }'
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
