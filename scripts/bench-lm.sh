#!/usr/bin/env bash
# Language-model benchmark: trains nanoGPT's CPU "baby GPT" (configs/shakespeare-char.toml) and
# reports ms/iteration, training tokens/s, final validation loss, peak memory, and generation
# speed with and without the KV cache. Not part of CI (it takes several minutes).
#
#   bash scripts/bench-lm.sh            # full 2000 iterations
#   STEPS=200 bash scripts/bench-lm.sh  # a quick look (stops early; val loss is then not comparable)
#   CONFIG=configs/shakespeare-char-rope.toml bash scripts/bench-lm.sh   # another config
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIG=${CONFIG:-configs/shakespeare-char.toml}
OUT=${OUT:-runs/bench-lm}
EMBER=./target/release/ember

echo "== build"
cargo build --release --workspace --locked 2>&1 | tail -1
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"

rm -rf "$OUT"
stop=()
if [ -n "${STEPS:-}" ]; then stop=(--stop-after "$STEPS"); fi
echo "== train: $EMBER train --config $CONFIG --out $OUT ${stop[*]:-}"
$EMBER train --config "$CONFIG" --out "$OUT" "${stop[@]}" 2>&1 | grep -E "^(step|done|peak|checkpoint:)"

echo "== val loss on the whole validation split (training's figure above samples 20 batches)"
cmd="$EMBER eval --checkpoint $OUT --split val"
echo "\$ $cmd"
$cmd | grep -E "^(loss|bits)"

echo "== generate (500 tokens, batch 1)"
for mode in "" "--no-cache"; do
    cmd="$EMBER generate --checkpoint $OUT --prompt ROMEO: --max-tokens 500 --seed 1 $mode"
    echo "\$ $cmd"
    $cmd 2>&1 >/dev/null | grep "tokens/s"
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
