#!/usr/bin/env bash
# Language-model benchmark: trains nanoGPT's CPU "baby GPT" (configs/shakespeare-char.toml, its
# learned position table started as scaled sinusoids) and the same model with rotary positions
# (configs/shakespeare-char-rope.toml), and reports for each
# ms/iteration, training tokens/s, final validation loss (training's 20-batch estimate and the
# whole split), peak memory, and generation speed with and without the KV cache. Not part of CI
# (it takes a few minutes).
#
#   bash scripts/bench-lm.sh            # both configs, 2000 iterations each
#   STEPS=200 bash scripts/bench-lm.sh  # a quick look (stops early; val loss is then not comparable)
#   CONFIGS=configs/shakespeare-char.toml bash scripts/bench-lm.sh   # one config
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIGS=${CONFIGS:-configs/shakespeare-char.toml configs/shakespeare-char-rope.toml}
EMBER=./target/release/ember

echo "== build"
cargo build --release --workspace --locked 2>&1 | tail -1
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"

stop=()
if [ -n "${STEPS:-}" ]; then stop=(--stop-after "$STEPS"); fi
for config in $CONFIGS; do
    out=runs/bench-lm-$(basename "$config" .toml)
    rm -rf "$out"
    echo "== train: $EMBER train --config $config --out $out ${stop[*]:-}"
    $EMBER train --config "$config" --out "$out" "${stop[@]}" 2>&1 | grep -E "^(step|done|peak|checkpoint:)"

    echo "== val loss on the whole validation split (training's figure above samples 20 batches)"
    cmd="$EMBER eval --checkpoint $out --split val"
    echo "\$ $cmd"
    $cmd | grep -E "^(loss|bits)"

    echo "== generate (500 tokens, batch 1)"
    for mode in "" "--no-cache"; do
        cmd="$EMBER generate --checkpoint $out --prompt ROMEO: --max-tokens 500 --seed 1 $mode"
        echo "\$ $cmd"
        $cmd 2>&1 >/dev/null | grep "tokens/s"
    done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
