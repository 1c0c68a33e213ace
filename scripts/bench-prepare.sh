#!/usr/bin/env bash
# Large corpora (not CI): `ember prepare` on a generated text of SIZE_MB megabytes (tiny
# Shakespeare repeated), against Hugging Face `tokenizers`' own parallel `encode_batch` from
# Python on the same file with the same tokenizer; then `ember train` from the prepared corpus
# against the same run from tiny Shakespeare prepared with that tokenizer (wall until one step
# is done and saved, peak memory). Peak memory and wall are GNU time's.
#
#   bash scripts/bench-prepare.sh                 # 1 GB, a BPE of 8000 tokens
#   SIZE_MB=111 TEXT_RUNS=1 bash scripts/bench-prepare.sh   # 111 MB, and the text path too
#
# EMBER the binary (default ./target/release/ember); WORK the folder for the corpus, the
# prepared folders and runs (default /tmp/ember-bench-prepare; the 1 GB text and its tokens
# take about 1.5 GB); VOCAB the BPE's tokens (default 8000); PYTHON an interpreter with
# `tokenizers` (pip install tokenizers); TEXT_RUNS=1 also trains straight from the text (a
# corpus under 64 MB only: larger ones are refused with a line saying to prepare them).
set -euo pipefail
cd "$(dirname "$0")/.."

EMBER=${EMBER:-./target/release/ember}
WORK=${WORK:-/tmp/ember-bench-prepare}
SIZE_MB=${SIZE_MB:-1024}
VOCAB=${VOCAB:-8000}
PYTHON=${PYTHON:-python3}
mkdir -p "$WORK"

measured() {
    echo "\$ $*"
    /usr/bin/time -f "  %e s wall, peak RSS %M KB" "$@"
}

echo "machine: $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p' | head -1)"
big=$WORK/big-${SIZE_MB}mb.txt
if [ ! -f "$big" ]; then
    size=$(stat -c %s data/tinyshakespeare.txt)
    copies=$(((SIZE_MB * 1000000 + size - 1) / size))
    for _ in $(seq "$copies"); do cat data/tinyshakespeare.txt; done >"$big"
fi
echo "corpus: $big, $(stat -c %s "$big") bytes"

rm -rf "$WORK/big.tokens"
measured "$EMBER" prepare "$big" --out "$WORK/big.tokens" --tokenizer bpe --vocab-size "$VOCAB"

# The same file and tokenizer through the library's own batch encoding, in batches of lines
# (the encoding alone timed, the reading not).
"$PYTHON" - "$big" "$WORK/big.tokens/tokenizer.json" <<'EOF'
import sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[2])
tokens, secs, nbytes, batch = 0, 0.0, 0, []
def flush():
    global tokens, secs
    t = time.perf_counter()
    tokens += sum(len(e.ids) for e in tok.encode_batch(batch, add_special_tokens=False))
    secs += time.perf_counter() - t
with open(sys.argv[1], encoding="utf-8") as f:
    for line in f:
        batch.append(line)
        nbytes += len(line.encode())
        if len(batch) == 100_000:
            flush()
            batch = []
if batch:
    flush()
print(f"tokenizers {__import__('tokenizers').__version__} encode_batch: {tokens} tokens in "
      f"{secs:.1f} s ({tokens / secs:.0f} tokens/s, {nbytes / 1e6 / secs:.1f} MB/s)")
EOF

# Training from the prepared corpus against the same model on tiny Shakespeare prepared with the
# same tokenizer: one step, checkpointed.
rm -rf "$WORK/tiny.tokens"
"$EMBER" prepare data/tinyshakespeare.txt --out "$WORK/tiny.tokens" \
    --tokenizer-file "$WORK/big.tokens/tokenizer.json" 2>/dev/null
for corpus in tiny.tokens big.tokens; do
    measured "$EMBER" train --config configs/tiny.toml --out "$WORK/run-$corpus" --overwrite \
        --set "data.path=\"$WORK/$corpus\"" --set 'data.tokenizer="bpe"' --stop-after 1 2>&1 |
        grep -E "data:|done:|wall|error" || true
done
if [ "${TEXT_RUNS:-0}" = 1 ]; then
    for tokenizer in char bpe; do
        measured "$EMBER" train --config configs/tiny.toml --out "$WORK/run-text-$tokenizer" \
            --overwrite --set "data.path=\"$big\"" --set "data.tokenizer=\"$tokenizer\"" \
            --set "data.bpe_vocab_size=$VOCAB" --stop-after 1 2>&1 | grep -E "data:|done:|wall|error" || true
    done
fi
