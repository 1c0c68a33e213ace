#!/usr/bin/env python3
"""A PyTorch eager reference for ember's translation training speed: the encoder-decoder of
configs/multi30k-de-en-2h.toml (3 + 3 pre-norm layers, width 256, 8 heads, feed-forward 1024,
ReLU, dropout 0.1, sinusoidal positions, embeddings scaled by sqrt(256), one table for source,
target and output, biases; 7,578,624 parameters, as ember counts them) built from
`torch.nn.Transformer`, trained with label smoothing 0.1, AdamW (betas 0.9 / 0.98, eps 1e-9) and
global-norm clipping 1.0 on the batches ember trains on: Multi30k's training pairs encoded with
the run's own BPE (`tokenizer.json` of an ember checkpoint, read by Hugging Face `tokenizers`),
filtered and cut by ember's rule (`ember_data::parallel`: sources end with <eos>, pairs over
`--max-len` tokens dropped, sorted by length, batches of at most `--batch-tokens` padded
tokens). Each epoch serves every batch once in a shuffled order, so a whole epoch is the same
work in both; PyTorch pads each batch to its own widths (ember on a GPU pads to a few
bucketed widths, its cost). Prints one JSON line: the timed epochs' target tokens per second
(the tokens ember's `tokens/s` counts), ms per step, and the batches and tokens of an epoch,
which must equal ember's `batches:` line.

    python3 scripts/torch_translation.py --tokenizer RUN/checkpoints/step-0000001/tokenizer.json
    python3 scripts/torch_translation.py --tokenizer ... --device cuda --precision tf32
    python3 scripts/torch_translation.py --tokenizer ... --count   # the epoch's batches only

Used by scripts/bench-gpu.sh's `mt` stage; not part of CI.
"""

import argparse
import json
import math
import random
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_reference import autocast, set_precision

PAD, BOS, EOS = 0, 1, 2

# nn.Transformer's note that pre-norm encoders take no nested tensors (padding stays padded).
warnings.filterwarnings("ignore", message="enable_nested_tensor is True")


def lines(path):
    """The lines of a text file as Rust's `str::lines` then `trim` give them."""
    text = Path(path).read_text(encoding="utf-8")
    rows = text.split("\n")
    if rows and rows[-1] == "":
        rows.pop()
    return [r.strip() for r in rows]


def pairs(tokenizer, src_path, tgt_path, max_len, max_pairs=None):
    """Encoded pairs (source with <eos>, target without specials) kept by ember's rule, from
    the first `max_pairs` lines (ember's `data.max_train_pairs`) where given."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    src, tgt = lines(src_path), lines(tgt_path)
    assert len(src) == len(tgt), f"{src_path} and {tgt_path} are not aligned"
    src, tgt = src[:max_pairs], tgt[:max_pairs]
    enc = lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    kept = []
    for s, t in zip(enc(src), enc(tgt)):
        s = s + [EOS]
        if len(s) > max_len or len(t) + 1 > max_len or not t or len(s) == 1:
            continue
        kept.append((s, t))
    return kept, tok.get_vocab_size()


def batches(kept, max_tokens):
    """ember's `Bucketed::new`: sorted by (source length, target length, index), then cut
    where the next pair would take the widest side past `max_tokens` padded tokens."""
    order = sorted(range(len(kept)), key=lambda i: (len(kept[i][0]), len(kept[i][1]), i))
    out, current, widest = [], [], 0
    for i in order:
        width = max(len(kept[i][0]), len(kept[i][1]) + 1)
        new_widest = max(widest, width)
        if current and new_widest * (len(current) + 1) > max_tokens:
            out.append(current)
            current, widest = [], width
        else:
            widest = new_widest
        current.append(i)
    out.append(current)
    return out


def tensors(kept, batch, device):
    """`(src, tgt_in, tgt_out, tokens)` of one batch, padded to its own widths."""
    s = max(len(kept[i][0]) for i in batch)
    t = max(len(kept[i][1]) + 1 for i in batch)
    pad = lambda row, width: row + [PAD] * (width - len(row))
    src = [pad(kept[i][0], s) for i in batch]
    tgt_in = [pad([BOS] + kept[i][1], t) for i in batch]
    tgt_out = [pad(kept[i][1] + [EOS], t) for i in batch]
    tokens = sum(len(kept[i][1]) + 1 for i in batch)
    as_tensor = lambda rows: torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)
    return as_tensor(src), as_tensor(tgt_in), as_tensor(tgt_out), tokens


class Translator(nn.Module):
    """One table for source and target tokens and the output head; fixed sinusoidal positions
    (sin at even, cos at odd columns); `nn.Transformer` with final norms on both stacks."""

    def __init__(self, vocab, d, heads, layers, d_ff, dropout, max_positions):
        super().__init__()
        self.scale = math.sqrt(d)
        self.embed = nn.Embedding(vocab, d)
        nn.init.normal_(self.embed.weight, 0.0, d**-0.5)
        pos = torch.arange(max_positions, dtype=torch.float32)[:, None]
        freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
        table = torch.stack([torch.sin(pos * freq), torch.cos(pos * freq)], dim=2)
        self.register_buffer("positions", table.reshape(max_positions, d))
        self.drop = nn.Dropout(dropout)
        self.transformer = nn.Transformer(
            d, heads, layers, layers, d_ff, dropout, activation="relu", batch_first=True,
            norm_first=True)

    def tokens(self, ids):
        return self.drop(self.embed(ids) * self.scale + self.positions[: ids.shape[1]])

    def forward(self, src, tgt_in):
        t = tgt_in.shape[1]
        # Boolean like the padding masks (true: not attended).
        causal = torch.ones(t, t, dtype=torch.bool, device=src.device).triu(1)
        y = self.transformer(
            self.tokens(src), self.tokens(tgt_in), tgt_mask=causal, tgt_is_causal=True,
            src_key_padding_mask=src == PAD, tgt_key_padding_mask=tgt_in == PAD,
            memory_key_padding_mask=src == PAD)
        return y @ self.embed.weight.T


def main():
    root = Path(__file__).resolve().parent.parent / "data" / "multi30k"
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer", required=True, help="an ember run's tokenizer.json")
    p.add_argument("--src", default=root / "train.de")
    p.add_argument("--tgt", default=root / "train.en")
    p.add_argument("--max-len", type=int, default=100)
    p.add_argument("--max-pairs", type=int, default=None, help="ember's data.max_train_pairs")
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--epochs", type=int, default=1, help="timed epochs, after the warm-up")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="untimed steps before them (default: a whole epoch)")
    p.add_argument("--count", action="store_true", help="print the epoch's batches and stop")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--precision", choices=["fp32", "tf32", "bf16"], default="fp32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kept, vocab = pairs(args.tokenizer, args.src, args.tgt, args.max_len,
                         args.max_pairs)
    epoch = batches(kept, args.batch_tokens)
    per_epoch = sum(len(kept[i][1]) + 1 for b in epoch for i in b)
    counts = {"pairs": len(kept), "batches_per_epoch": len(epoch),
              "target_tokens_per_epoch": per_epoch, "vocab": vocab}
    if args.count:
        print(json.dumps(counts))
        return
    torch.manual_seed(args.seed)
    model = Translator(vocab, 256, 8, 3, 1024, 0.1, 128).to(args.device)
    params = sum(p.numel() for p in model.parameters())
    set_precision(args)
    opt = torch.optim.AdamW(model.parameters(), lr=7e-4, betas=(0.9, 0.98), eps=1e-9,
                            weight_decay=0.0, foreach=True)
    cuda = args.device.startswith("cuda")
    order = random.Random(args.seed)

    def run_epoch(steps=None):
        shuffled = list(epoch)
        order.shuffle(shuffled)
        losses = []
        for batch in shuffled[:steps]:
            src, tgt_in, tgt_out, _ = tensors(kept, batch, args.device)
            with autocast(args):
                logits = model(src, tgt_in)
            loss = F.cross_entropy(logits.float().flatten(0, 1), tgt_out.flatten(),
                                   ignore_index=PAD, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())  # one host sync per step, as ember's loss check
        return losses

    model.train()
    run_epoch(args.warmup_steps)  # untimed: the device's start-up, the libraries' first choices
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    losses = []
    for _ in range(args.epochs):
        losses += run_epoch()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    steps = args.epochs * len(epoch)
    print(json.dumps({
        "what": "translation", **counts, "parameters": params, "timed_epochs": args.epochs,
        "seconds": seconds, "ms_per_step_mean": 1000 * seconds / steps,
        "tokens_per_sec": args.epochs * per_epoch / seconds,
        "last_epoch_mean_loss": sum(losses[-len(epoch):]) / len(epoch),
        "device": args.device, "precision": args.precision, "threads": torch.get_num_threads(),
        "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        "torch": torch.__version__}))


if __name__ == "__main__":
    main()
