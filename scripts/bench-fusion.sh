#!/usr/bin/env bash
# Sampling on a cubecl device (wgpu by default) with and without Burn's fusion + autotuning, in
# one run, alternating: a greedy sample of TOKENS tokens with the KV cache from one checkpoint,
# by a build with `--features wgpu` and one with `--features wgpu,fusion`. Prints seconds and
# tokens/s per run, the medians, the kernels autotuned and compiled by each build in a logged
# run, and fails if the two builds generate different text. Not part of CI.
#
#   bash scripts/bench-fusion.sh                       # lavapipe or any Vulkan driver
#   ROUNDS=5 TOKENS=400 DEVICE=vulkan FEATURES=wgpu,vulkan bash scripts/bench-fusion.sh
#
# Without a GPU it needs Mesa's software Vulkan: apt-get install mesa-vulkan-drivers libvulkan1.
# Burn keeps autotune results in target/environment (cubecl's persistent cache, found from the
# working directory); the script empties it first, so round 1 tunes and later rounds reuse.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-3}
TOKENS=${TOKENS:-400}
DEVICE=${DEVICE:-wgpu}
FEATURES=${FEATURES:-wgpu}
CONFIG=${CONFIG:-configs/tiny.toml}
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

for variant in plain fusion; do
    features=$FEATURES
    [ "$variant" = fusion ] && features="$FEATURES,fusion"
    echo "build $variant: --features $features"
    CARGO_TARGET_DIR=target/bench-$variant cargo build --release --locked -p ember-cli \
        --features "$features" 2>&1 | tail -1
done
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
./target/bench-plain/release/ember train --config "$CONFIG" --out "$WORK/run" --device flex \
    > "$WORK/train.log" 2>&1 || { cat "$WORK/train.log"; exit 1; }
rm -rf target/environment

median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
generate() { # variant, then extra environment
    local variant=$1; shift
    env "$@" ./target/bench-$variant/release/ember generate --checkpoint "$WORK/run" \
        --prompt "ROMEO:" --max-tokens "$TOKENS" --greedy --device "$DEVICE" \
        > "$WORK/text-$variant" 2> "$WORK/err-$variant"
}

for round in $(seq "$ROUNDS"); do
    for variant in plain fusion; do
        start=$(date +%s.%N)
        generate "$variant" || { cat "$WORK/err-$variant"; exit 1; }
        secs=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN {printf "%.2f", b - a}')
        tps=$(sed -n 's/.*(\([0-9.]*\) tokens\/s.*/\1/p' "$WORK/err-$variant")
        echo "round $round, $variant: $secs s, $tps tokens/s"
        echo "$tps" >> "$WORK/tps-$variant"
        echo "$secs" >> "$WORK/secs-$variant"
    done
    cmp -s "$WORK/text-plain" "$WORK/text-fusion" || {
        echo "the two builds generated different text:"; head -c 300 "$WORK/text-plain"; echo
        head -c 300 "$WORK/text-fusion"; echo; exit 1; }
done

for variant in plain fusion; do
    rm -rf target/environment
    generate "$variant" CUBECL_DEBUG_LOG="$WORK/cubecl-$variant.log" || true
    log="$WORK/cubecl-$variant.log"
    tunes=$( (grep -ci 'autotun' "$log" || true) )
    compiles=$( (grep -ci 'compil' "$log" || true) )
    echo "$variant, a logged run from an empty autotune cache: $tunes autotune lines, $compiles compilation lines ($DEVICE, $TOKENS tokens)"
done
for variant in plain fusion; do
    echo "$variant: median $(median < "$WORK/tps-$variant") tokens/s, $(median < "$WORK/secs-$variant") s over $ROUNDS rounds"
done
echo "same text from both builds: yes ($TOKENS tokens, greedy, $CONFIG)"
