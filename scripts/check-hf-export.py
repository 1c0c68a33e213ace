#!/usr/bin/env python3
"""Checks that a folder written by `ember export --format hf` loads in transformers and computes
what ember computes.

    ember export --checkpoint runs/small --out /tmp/small-hf
    python3 scripts/check-hf-export.py /tmp/small-hf [ember binary]

Loads the folder with `AutoModelForCausalLM.from_pretrained` (GPT-2 for a model with learned
positions, GPT-NeoX for rotary ones) and `AutoTokenizer.from_pretrained`,
then compares with the ember binary on the same folder: the loss on a short text
(`ember eval --json`) and a greedy continuation (`ember generate --greedy`). Needs torch and
transformers (PyPI). Exits non-zero when they disagree.
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?"
PROMPT = "ROMEO:"
NEW_TOKENS = 40


def main(folder: str, ember: str) -> int:
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    config = model.config
    tokenizer = AutoTokenizer.from_pretrained(folder)
    print(f"transformers loaded {folder} as {type(model).__name__}: "
          f"{config.num_hidden_layers} layers, width {config.hidden_size}, "
          f"vocab {config.vocab_size}, "
          f"{sum(p.numel() for p in model.parameters())} parameters")

    ids = tokenizer(TEXT)["input_ids"]
    ids = ids[: config.max_position_embeddings + 1]
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]])).logits[0]
        hf_loss = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).item()
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(tokenizer.decode(ids))
    report = json.loads(subprocess.run(
        [ember, "eval", "--checkpoint", folder, "--data", f.name, "--json"],
        check=True, capture_output=True, text=True).stdout)
    print(f"loss on {len(ids) - 1} predictions: transformers {hf_loss:.6f}, "
          f"ember {report['loss']:.6f}")

    prompt = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    # transformers cannot go past the positional table; ember would slide its window.
    new_tokens = min(NEW_TOKENS, config.max_position_embeddings - prompt.shape[1])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    hf_text = tokenizer.decode(out[0, prompt.shape[1]:])
    ember_text = subprocess.run(
        [ember, "generate", "--checkpoint", folder, "--prompt", PROMPT, "--greedy",
         "--max-tokens", str(new_tokens)],
        check=True, capture_output=True, text=True).stdout
    ember_text = ember_text[len(PROMPT):] if ember_text.startswith(PROMPT) else ember_text
    print(f"greedy, transformers: {hf_text!r}")
    print(f"greedy, ember:        {ember_text!r}")

    ok = abs(hf_loss - report["loss"]) < 1e-4 and ember_text.rstrip("\n") == hf_text
    print("AGREE" if ok else "DISAGREE")
    return 0 if ok else 1


if __name__ == "__main__":
    binary = sys.argv[2] if len(sys.argv) > 2 else str(
        Path(__file__).resolve().parent.parent / "target" / "release" / "ember")
    sys.exit(main(sys.argv[1], binary))
