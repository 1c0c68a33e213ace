#!/usr/bin/env python3
"""Makes the tiny GPT-2 fixture that ember's Hugging Face import is tested against.

A small byte-level BPE tokenizer trained on the start of tiny Shakespeare, a 2-layer GPT-2 of
width 32 with every parameter random (biases and LayerNorm weights included, so that a wrong
name mapping cannot hide behind zeros and ones), saved with `save_pretrained`, and the logits
and greedy continuation transformers computes for a fixed prompt.

    python3 -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers tokenizers safetensors
    /tmp/hf/bin/python scripts/make-gpt2-fixture.py crates/ember-train/tests/fixtures/tiny-gpt2

The output is committed, so the tests need no Python.
"""

import json
import sys
from pathlib import Path

import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel

PROMPT = "ROMEO: What light through yonder window"
GREEDY_TOKENS = 16


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    corpus = Path(__file__).resolve().parent.parent / "data" / "tinyshakespeare.txt"
    text = corpus.read_text()[:50_000]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([text], trainer)
    tok.save(str(out / "tokenizer.json"))

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=tok.get_vocab_size(),
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        activation_function="gelu_new",
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(out, safe_serialization=True)

    ids = tok.encode(PROMPT).ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
        greedy = model.generate(
            torch.tensor([ids]),
            max_new_tokens=GREEDY_TOKENS,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )[0, len(ids):]
    expected = {
        "made_with": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "prompt": PROMPT,
        "input_ids": ids,
        "logits_shape": list(logits.shape),
        "logits": [round(float(x), 7) for x in logits.flatten()],
        "greedy_ids": greedy.tolist(),
    }
    (out / "expected.json").write_text(json.dumps(expected))
    print(f"wrote {out}: {len(ids)} prompt tokens, vocab {config.vocab_size}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "crates/ember-train/tests/fixtures/tiny-gpt2"))
