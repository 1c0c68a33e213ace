#!/usr/bin/env python3
"""The Hugging Face side of scripts/bench-hf-generate.sh.

    make OUT       a GPT-2 124M-shaped model with random weights (12 x 768, 12 heads, 1024
                   positions, 50257 tokens), saved by `save_pretrained` as ember and transformers
                   both load it, with a byte-level BPE trained on tiny Shakespeare and padded
                   with filler tokens to GPT-2's vocabulary size. Decoding costs what GPT-2's
                   does whatever the weights are (the hub is not reachable from every machine).
                   With --llama, SmolLM-135M's shape instead (`LlamaForCausalLM`: 30 x 576, 9
                   query heads sharing 3 key/value heads, SwiGLU of 1536, RMSNorm, a tied
                   head, 49152 tokens).
    generate DIR   greedy decoding of every line of --prompts as one left-padded batch by
                   transformers' `generate` with its KV cache; prints the new tokens per second.
"""

import argparse
import time
from pathlib import Path

import torch


def make(out: Path, layers: int, width: int, heads: int, llama: bool) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    text = (Path(__file__).resolve().parent.parent / "data" / "tinyshakespeare.txt").read_text()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8000,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([text], trainer)
    vocab = 49152 if llama else 50257
    tok.add_tokens([f"<f{i}>" for i in range(vocab - tok.get_vocab_size())])
    tok.save(str(out / "tokenizer.json"))
    torch.manual_seed(0)
    if llama:
        config = LlamaConfig(
            vocab_size=vocab, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
            bos_token_id=0, eos_token_id=0,
        )
        LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
        return
    config = GPT2Config(
        vocab_size=50257, n_positions=1024, n_embd=width, n_layer=layers, n_head=heads,
        bos_token_id=0, eos_token_id=0,
    )
    GPT2LMHeadModel(config).save_pretrained(out, safe_serialization=True)


def generate(folder: str, prompts: str, tokens: int, threads: int) -> None:
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.set_num_threads(threads)
    tok = PreTrainedTokenizerFast(
        tokenizer_file=f"{folder}/tokenizer.json", pad_token="<|endoftext|>", padding_side="left"
    )
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    batch = tok(Path(prompts).read_text().splitlines(), return_tensors="pt", padding=True)
    args = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(**batch, max_new_tokens=4, min_new_tokens=4, **args)  # warm-up
        start = time.perf_counter()
        out = model.generate(**batch, max_new_tokens=tokens, min_new_tokens=tokens, **args)
        seconds = time.perf_counter() - start
    new = (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    print(f"{new} tokens in {seconds:.2f}s ({new / seconds:.1f} tokens/s)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["make", "generate"])
    p.add_argument("folder")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--llama", action="store_true")
    p.add_argument("--prompts")
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    if a.mode == "make":
        make(Path(a.folder), a.layers, a.width, a.heads, a.llama)
    else:
        generate(a.folder, a.prompts, a.tokens, a.threads)


if __name__ == "__main__":
    main()
