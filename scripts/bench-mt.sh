#!/usr/bin/env bash
# Translation benchmark: trains configs/multi30k-de-en.toml (German -> English), then translates
# Multi30k test2016 greedily and with beam search and scores both with sacreBLEU-compatible
# cased BLEU. Prints training time, ms/step, tokens/s and the BLEU figures. Not part of CI.
#
#   bash scripts/bench-mt.sh                 # the full run (hours on 2 CPU cores)
#   STEPS=1000 bash scripts/bench-mt.sh      # stop after 1000 steps
#   CONFIG=configs/multi30k-de-en-2h.toml LENGTH_PENALTY=1.5 bash scripts/bench-mt.sh
#   CONFIG=configs/multi30k-de-en-2h-flex2.toml LENGTH_PENALTY=1.0 AVERAGE=5 bash scripts/bench-mt.sh
#       (AVERAGE=N also scores the mean of the run's newest N checkpoints: `ember average`)
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIG=${CONFIG:-configs/multi30k-de-en.toml}
OUT=${OUT:-runs/bench-mt}
EMBER=./target/release/ember
TEST_SRC=data/multi30k/test_2016_flickr.de
TEST_REF=data/multi30k/test_2016_flickr.en
LENGTH_PENALTY=${LENGTH_PENALTY:-0.6}

echo "== build"
cargo build --release --workspace --locked 2>&1 | tail -1
echo "machine: $(nproc) cores, load before: $(cut -d' ' -f1-3 /proc/loadavg)"

stop=()
if [ -n "${STEPS:-}" ]; then stop=(--stop-after "$STEPS"); fi
resume=()
if [ -n "${RESUME:-}" ]; then resume=(--resume); else rm -rf "$OUT"; fi
echo "== train: $EMBER train --config $CONFIG --out $OUT ${stop[*]:-} ${resume[*]:-}"
start=$(date +%s)
$EMBER train --config "$CONFIG" --out "$OUT" "${stop[@]}" "${resume[@]}" 2>&1 | grep -E "^(data|step|done|peak|checkpoint:)"
echo "training wall time: $(( $(date +%s) - start )) s"

checkpoints=("$OUT")
if [ -n "${AVERAGE:-}" ]; then
    rm -rf "$OUT-avg$AVERAGE"
    echo "== average: $EMBER average $OUT --last $AVERAGE --out $OUT-avg$AVERAGE"
    $EMBER average "$OUT" --last "$AVERAGE" --out "$OUT-avg$AVERAGE"
    checkpoints+=("$OUT-avg$AVERAGE")
fi
for checkpoint in "${checkpoints[@]}"; do
    for beam in 1 4; do
        hyp="$checkpoint/test2016.beam$beam.en"
        cmd=($EMBER translate --checkpoint "$checkpoint" --input "$TEST_SRC" --beam "$beam" --length-penalty "$LENGTH_PENALTY")
        echo "== translate test2016, beam $beam: ${cmd[*]}"
        t0=$(date +%s)
        "${cmd[@]}" > "$hyp"
        echo "   $(( $(date +%s) - t0 )) s"
        echo "   cased:      $($EMBER bleu --hyp "$hyp" --ref "$TEST_REF")"
        echo "   lowercased: $($EMBER bleu --hyp "$hyp" --ref "$TEST_REF" --lowercase)"
    done
done
echo "loss curves: $OUT/loss.png, metrics: $OUT/metrics.jsonl"
