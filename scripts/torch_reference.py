#!/usr/bin/env python3
"""A short PyTorch eager reference for ember's speed benchmarks: nanoGPT's model (pre-norm,
learned positions, no biases, tied head, exact GELU) and training step (AdamW with decay on
matrices only, global-norm clipping 1.0), on tiny Shakespeare characters, with nanoGPT's CPU
"baby GPT" sizes by default. Prints one JSON line.

    python3 scripts/torch_reference.py train --steps 100 --threads 2
    python3 scripts/torch_reference.py generate --tokens 500 --threads 2 [--no-cache]
    python3 scripts/torch_reference.py quality --steps 2000   # nanoGPT's run: val loss
    python3 scripts/torch_reference.py quality --steps 5000 --device cuda --d-model 384 \
        --heads 6 --layers 6 --context 256 --batch 64 --dropout 0.2 --eval-batches 200
    python3 scripts/torch_reference.py train --device cuda --d-model 384 --heads 6 --layers 6 \
        --context 256 --batch 64 --dropout 0.2                 # nanoGPT's GPU config
    python3 scripts/torch_reference.py train --llama --kv-heads 2 --d-ff 344
        # configs/small-llama.toml's model: RMSNorm, rotary positions, SwiGLU, grouped keys

Used by scripts/bench-compare.sh; not part of CI.
"""

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


def cached(cache, k, v):
    """Keys and values `[B, H, T, K]` appended to the KV cache `cache` (a dict), if one, and all
    of them returned."""
    if cache is None:
        return k, v
    if "k" in cache:
        k = torch.cat([cache["k"], k], dim=2)
        v = torch.cat([cache["v"], v], dim=2)
    cache["k"], cache["v"] = k, v
    return k, v


class Block(nn.Module):
    def __init__(self, d, h, dropout):
        super().__init__()
        self.h = h
        self.p = dropout
        self.drop = nn.Dropout(dropout)
        self.ln_1 = nn.LayerNorm(d, bias=False)
        self.c_attn = nn.Linear(d, 3 * d, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.ln_2 = nn.LayerNorm(d, bias=False)
        self.c_fc = nn.Linear(d, 4 * d, bias=False)
        self.mlp_proj = nn.Linear(4 * d, d, bias=False)

    def attn(self, x, cache):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        k, v = cached(cache, k, v)
        # Causal when the queries are the whole sequence; one new query sees every key.
        p = self.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, dropout_p=p)
        return self.drop(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d)))

    def forward(self, x, cache=None):
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.drop(self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)))))


def rotate(x, start):
    """Rotary positions, "rotate half" (LLaMA's and ember's), base 10000, positions `start..`."""
    t, k = x.shape[-2], x.shape[-1]
    freq = 10000.0 ** (-torch.arange(0, k, 2, dtype=torch.float32, device=x.device) / k)
    angles = torch.arange(start, start + t, dtype=torch.float32, device=x.device)[:, None] * freq
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., : k // 2], x[..., k // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class LlamaBlock(nn.Module):
    """LLaMA's block: RMSNorm, rotary positions, `kv` key/value heads shared by the `h` query
    heads, a SwiGLU MLP of width `f`; no biases."""

    def __init__(self, d, h, kv, f, dropout):
        super().__init__()
        self.h, self.kv, self.p = h, kv, dropout
        self.drop = nn.Dropout(dropout)
        self.ln_1 = nn.RMSNorm(d, eps=1e-5)
        self.c_attn = nn.Linear(d, d + 2 * (d // h) * kv, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.ln_2 = nn.RMSNorm(d, eps=1e-5)
        self.c_fc = nn.Linear(d, 2 * f, bias=False)
        self.mlp_proj = nn.Linear(f, d, bias=False)

    def attn(self, x, cache, start):
        b, t, d = x.shape
        k_size = d // self.h
        q, k, v = self.c_attn(x).split([d, self.kv * k_size, self.kv * k_size], dim=2)
        q = rotate(q.view(b, t, self.h, k_size).transpose(1, 2), start)
        k = rotate(k.view(b, t, self.kv, k_size).transpose(1, 2), start)
        v = v.view(b, t, self.kv, k_size).transpose(1, 2)
        k, v = cached(cache, k, v)
        p = self.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, dropout_p=p, enable_gqa=True)
        return self.drop(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d)))

    def forward(self, x, cache=None, start=0):
        x = x + self.attn(self.ln_1(x), cache, start)
        gate, up = self.c_fc(self.ln_2(x)).chunk(2, dim=-1)
        return x + self.drop(self.mlp_proj(F.silu(gate) * up))


class GPT(nn.Module):
    def __init__(self, vocab, d, h, layers, context, dropout=0.0, position_init="normal",
                 llama=None):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        # `llama`: (key/value heads, MLP width) of LLaMA's blocks, whose positions are rotary.
        self.llama = llama
        self.wpe = None if llama else nn.Embedding(context, d)
        self.drop = nn.Dropout(dropout)
        if llama:
            kv, f = llama
            self.blocks = nn.ModuleList([LlamaBlock(d, h, kv, f, dropout) for _ in range(layers)])
            self.ln_f = nn.RMSNorm(d, eps=1e-5)
        else:
            self.blocks = nn.ModuleList([Block(d, h, dropout) for _ in range(layers)])
            self.ln_f = nn.LayerNorm(d, bias=False)
        self.apply(self._init)
        # nanoGPT's scaled init of the projections into the residual stream ("c_proj.weight").
        for block in self.blocks:
            for proj in (block.c_proj, block.mlp_proj):
                nn.init.normal_(proj.weight, 0.0, 0.02 / math.sqrt(2 * layers))
        if position_init == "sinusoidal":
            # ember's `position_init = "sinusoidal"`: Vaswani's table (sin at 2i, cos at 2i + 1),
            # scaled to a root mean square of 0.02.
            pos = torch.arange(context, dtype=torch.float32)[:, None]
            freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
            table = torch.stack([torch.sin(pos * freq), torch.cos(pos * freq)], dim=2)
            with torch.no_grad():
                self.wpe.weight.copy_(table.reshape(context, d) * 0.02 * math.sqrt(2))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx, caches=None, start=0):
        t = idx.shape[1]
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(start, start + t, device=idx.device))
        x = self.drop(x)
        for i, block in enumerate(self.blocks):
            cache = None if caches is None else caches[i]
            x = block(x, cache, start) if self.llama else block(x, cache)
        return self.ln_f(x) @ self.wte.weight.T


def corpus():
    """Vocabulary size and the train / val ids of tiny Shakespeare (first 90% / last 10%)."""
    text = (Path(__file__).resolve().parent.parent / "data" / "tinyshakespeare.txt").read_text()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text])
    n = int(0.9 * len(ids))
    return len(chars), ids[:n], ids[n:]


def batch(ids, context, size, generator=None, device="cpu"):
    """`size` random windows of `context` tokens and their next tokens, on `device`."""
    ix = torch.randint(len(ids) - context - 1, (size,), generator=generator)
    x = torch.stack([ids[i:i + context] for i in ix])
    y = torch.stack([ids[i + 1:i + 1 + context] for i in ix])
    return x.to(device), y.to(device)


def set_precision(args):
    """`--precision`: fp32 (TF32 off), tf32 (fp32 with TF32 matmuls allowed: what ember's CUDA
    backend does on sm80+), bf16 (autocast to bfloat16, fp32 weights)."""
    if args.device.startswith("cuda"):
        tf32 = args.precision != "fp32"
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32


def autocast(args):
    """The forward pass's autocast context for `--precision`."""
    enabled = args.precision == "bf16"
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    return torch.autocast(device, dtype=torch.bfloat16, enabled=enabled)


def step(model, opt, x, y, cast=None):
    """One optimizer step (global-norm clipping 1.0); returns the loss tensor."""
    with cast if cast is not None else torch.autocast("cpu", enabled=False):
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), y.view(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


def adamw(model):
    """nanoGPT's optimizer: weight decay 0.1 on matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=1e-3, betas=(0.9, 0.99), foreach=True)


def train(args):
    torch.manual_seed(1337)
    llama = (args.kv_heads or args.heads, args.d_ff) if args.llama else None
    model = GPT(66, args.d_model, args.heads, args.layers, args.context, args.dropout,
                llama=llama)
    model = model.to(args.device)
    set_precision(args)
    opt = adamw(model)
    forward = torch.compile(model) if args.compile else model
    _, train_ids, _ = corpus()
    g = torch.Generator().manual_seed(1)
    times = []
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.steps + args.warmup):
        x, y = batch(train_ids, args.context, args.batch, g, args.device)
        t0 = time.perf_counter()
        step(forward, opt, x, y, autocast(args)).item()  # one host sync per step, as ember logs
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    times.sort()
    ms = 1000 * times[len(times) // 2]
    tokens = args.batch * args.context
    print(json.dumps({"what": "train", "ms_per_step_median": ms,
                      "ms_per_step_mean": 1000 * sum(times) / len(times),
                      "tokens_per_sec": tokens / (ms / 1000), "steps": len(times),
                      "threads": torch.get_num_threads(), "device": args.device,
                      "precision": args.precision, "compiled": args.compile,
                      "peak_gpu_mib": (torch.cuda.max_memory_allocated() / 2**20
                                       if args.device.startswith("cuda") else None),
                      "peak_gpu_reserved_mib": (torch.cuda.max_memory_reserved() / 2**20
                                                if args.device.startswith("cuda") else None),
                      "torch": torch.__version__}))
    if args.profile:
        profile_steps(args, forward, opt, train_ids, g)


def profile_steps(args, forward, opt, train_ids, g):
    """`--profile N`: N more steps under torch.profiler, its table of kernels (ops on a CPU) by
    device time, as `ember train --profile-steps` prints ember's."""
    from torch.profiler import ProfilerActivity, profile
    cuda = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(args.profile):
            x, y = batch(train_ids, args.context, args.batch, g, args.device)
            step(forward, opt, x, y, autocast(args)).item()
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    if cuda and not hasattr(events[0], key):
        key = "self_cuda_time_total"  # older PyTorch
    print(f"PyTorch profile of {args.profile} steps ({args.precision}"
          f"{', compiled' if args.compile else ''}), by {key}:")
    print(events.table(sort_by=key, row_limit=25))
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        print(f"{len(kernels) / args.profile:.0f} kernel launches/step")


def quality(args):
    """nanoGPT's training run: `--steps` iterations (2000 for the baby GPT, 5000 for the GPU
    config), warmup 100, cosine 1e-3 -> 1e-4 over the run, then the validation loss two ways:
    nanoGPT's estimate (mean of `--eval-batches` random batches, 20 by default; nanoGPT uses
    200) and the whole val split in consecutive windows of `context` predictions (what
    `ember eval` computes). On `--device cuda` the loop syncs with the host only at the end."""
    torch.manual_seed(args.seed)
    vocab, train_ids, val_ids = corpus()
    model = GPT(vocab, args.d_model, args.heads, args.layers, args.context, args.dropout,
                args.position_init)
    model = model.to(args.device)
    opt = adamw(model)

    def lr_at(it, warmup=100, decay_iters=args.steps, lr=1e-3, min_lr=1e-4):
        if it < warmup:
            return lr * (it + 1) / (warmup + 1)
        ratio = (it - warmup) / (decay_iters - warmup)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    sync()
    start = time.perf_counter()
    for it in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(it)
        step(model, opt, *batch(train_ids, args.context, args.batch, device=args.device))
    sync()
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        batches = (batch(val_ids, args.context, args.batch, device=args.device)
                   for _ in range(args.eval_batches))
        estimate = sum(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
                       for x, y in batches) / args.eval_batches
        nll, count = 0.0, 0
        for s in range(0, len(val_ids) - 1, args.context):
            x = val_ids[s:s + args.context]
            y = val_ids[s + 1:s + 1 + args.context]
            x = x[:len(y)].to(args.device)
            logits = model(x[None])[0]
            nll += F.cross_entropy(logits, y.to(args.device), reduction="sum").item()
            count += len(y)
    print(json.dumps({"what": "quality", "steps": args.steps, "seconds": seconds,
                      "val_loss_estimate": estimate, "eval_batches": args.eval_batches,
                      "val_loss_full": nll / count, "device": args.device,
                      "position_init": args.position_init,
                      "threads": torch.get_num_threads(), "torch": torch.__version__}))


@torch.no_grad()
def generate(args):
    torch.manual_seed(1337)
    model = GPT(66, args.d_model, args.heads, args.layers, args.context).to(args.device).eval()

    def sample(tokens):
        idx = torch.tensor([[1, 2, 3, 4, 5, 6]], device=args.device)
        if args.no_cache:
            for _ in range(tokens):
                window = idx[:, -args.context:]
                logits = model(window)[:, -1]
                idx = torch.cat([idx, torch.multinomial(F.softmax(logits / 0.8, -1), 1)], 1)
        else:
            # A KV cache; when the context is full, rebuild it from the newest half (as ember
            # does).
            produced = 0
            while produced < tokens:
                window = idx[:, -(args.context // 2):] if idx.shape[1] >= args.context else idx
                caches = [{} for _ in model.blocks]
                logits = model(window, caches)[:, -1]
                pos = window.shape[1]
                while produced < tokens and pos < args.context:
                    nxt = torch.multinomial(F.softmax(logits / 0.8, -1), 1)
                    idx = torch.cat([idx, nxt], 1)
                    produced += 1
                    logits = model(nxt, caches, start=pos)[:, -1]
                    pos += 1
        idx.tolist()  # waits for the device

    # Untimed first: the device's start-up and its libraries' first kernels (ember's figure
    # is taken from a second run too; see bench-gpu.sh).
    sample(args.tokens)
    t0 = time.perf_counter()
    sample(args.tokens)
    dt = time.perf_counter() - t0
    print(json.dumps({"what": "generate", "device": args.device, "cache": not args.no_cache,
                      "tokens": args.tokens,
                      "tokens_per_sec": args.tokens / dt, "threads": torch.get_num_threads(),
                      "torch": torch.__version__}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["train", "generate", "quality"])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--tokens", type=int, default=500)
    p.add_argument("--no-cache", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--llama", action="store_true", help="train mode: LLaMA's blocks")
    p.add_argument("--kv-heads", type=int, default=0, help="--llama: key/value heads")
    p.add_argument("--d-ff", type=int, default=344, help="--llama: the SwiGLU's width")
    p.add_argument("--eval-batches", type=int, default=20, help="quality mode's estimate")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--precision", choices=["fp32", "tf32", "bf16"], default="fp32",
                   help="train mode: fp32 (TF32 off), fp32 with TF32 matmuls, bf16 autocast")
    p.add_argument("--compile", action="store_true", help="train mode: torch.compile the model")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="train mode: then profile N steps (torch.profiler) and print its table")
    p.add_argument("--position-init", choices=["normal", "sinusoidal"], default="normal",
                   help="how the learned position table starts (quality mode)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    {"train": train, "generate": generate, "quality": quality}[args.mode](args)


if __name__ == "__main__":
    main()
