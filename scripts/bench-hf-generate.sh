#!/usr/bin/env bash
# Decoding a GPT-2 124M-shaped model on CPU: `ember generate` against transformers' `generate`
# (PyTorch eager, KV cache) on the same Hugging Face folder, in one run, alternating; greedy,
# batches of 1, 4 and 8 prompts (one left-padded batch each). Prints each measurement, the
# medians and the ratios (ember / transformers, higher is better for ember). Not part of CI.
#
#   bash scripts/bench-hf-generate.sh                 # 3 rounds, 200 tokens at batch 1, 60 above
#   ROUNDS=5 BATCHES="1 2 4" THREADS=2 bash scripts/bench-hf-generate.sh
#   AGAINST=/path/to/older/ember bash scripts/bench-hf-generate.sh   # and check the same text
#   LLAMA=1 bash scripts/bench-hf-generate.sh         # SmolLM-135M's shape (Llama, 3 of 9 heads' keys)
#
# Needs torch, transformers and tokenizers (PYTHON=.venv/bin/python). The model is made once
# with random weights (scripts/hf_generate.py make) into MODEL (default target/bench-gpt2-124m).
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-3}
BATCHES=${BATCHES:-1 4 8}
THREADS=${THREADS:-2}
PYTHON=${PYTHON:-python3}
AGAINST=${AGAINST:-}
LLAMA=${LLAMA:-}
MODEL=${MODEL:-target/bench-$([ -n "$LLAMA" ] && echo smollm-135m || echo gpt2-124m)}
EMBER=./target/release/ember
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

cargo build --release --workspace --locked 2>&1 | tail -1
[ -e "$MODEL/model.safetensors" ] || $PYTHON scripts/hf_generate.py make "$MODEL" ${LLAMA:+--llama}
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
echo "torch: $($PYTHON -c 'import torch, transformers as t; print(torch.__version__, "transformers", t.__version__)'), threads $THREADS"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"

median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
tokens_for() { [ "$1" = 1 ] && echo 200 || echo 60; }
# "N tokens in S s" (both sides print it) as tokens per second, one decimal.
rate() { sed -n 's/^\([0-9]*\) tokens in \([0-9.]*\)s.*/\1 \2/p' | tail -1 | awk '{printf "%.1f", $1 / $2}'; }
for b in $BATCHES; do
    for i in $(seq "$b"); do echo "ROMEO: line $i"; done > "$WORK/prompts$b"
    : > "$WORK/e$b"; : > "$WORK/r$b"
done

for round in $(seq "$ROUNDS"); do
    echo "== round $round"
    for b in $BATCHES; do
        n=$(tokens_for "$b")
        for side in e r; do
            bin=$EMBER; [ "$side" = r ] && bin=$AGAINST
            if [ "$side" = e ] || [ -n "$AGAINST" ]; then
                cmd="$bin generate --checkpoint $MODEL --prompt-file $WORK/prompts$b --batch-size $b --max-tokens $n --ignore-eot --greedy --no-echo"
                RAYON_NUM_THREADS=$THREADS $cmd > "$WORK/text-$side" 2> "$WORK/log"
                tps=$(rate < "$WORK/log")
            else
                cmd="$PYTHON scripts/hf_generate.py generate $MODEL --prompts $WORK/prompts$b --tokens $n --threads $THREADS"
                tps=$($cmd 2>/dev/null | rate)
            fi
            echo "$side batch $b: $tps tokens/s   ($cmd)"; echo "$tps" >> "$WORK/$side$b"
        done
        if [ -n "$AGAINST" ] && ! cmp -s "$WORK/text-e" "$WORK/text-r"; then
            echo "batch $b: the two builds generated different text"; exit 1
        fi
    done
done

REF=transformers; [ -n "$AGAINST" ] && REF=against
echo "== medians (e: ember, r: $REF)"
for b in $BATCHES; do
    e=$(median < "$WORK/e$b"); r=$(median < "$WORK/r$b")
    echo "batch $b: ember $e tokens/s, $REF $r tokens/s, ratio $(awk -v e="$e" -v r="$r" 'BEGIN {printf "%.2f", e / r}')"
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
