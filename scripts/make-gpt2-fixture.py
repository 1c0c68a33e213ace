#!/usr/bin/env python3
"""Makes the tiny GPT-2 and GPT-NeoX fixtures that ember's Hugging Face import is tested against.

A small byte-level BPE tokenizer trained on the start of tiny Shakespeare, a 2-layer GPT-2 of
width 32 with every parameter random (biases and LayerNorm weights included, so that a wrong
name mapping cannot hide behind zeros and ones), saved with `save_pretrained`, and the logits
and greedy continuation transformers computes for a fixed prompt. With `--neox`, a GPT-NeoX
instead in the layout ember reads (rotary positions over whole heads, attention then MLP, an
untied head): the fused projection's per-head grouping and the `[out, in]` weights are what its
test checks. With `--pythia`, a GPT-NeoX as Pythia's models are: attention and MLP side by side
(`use_parallel_residual`) and a quarter of each head rotated (`rotary_pct = 0.25`). With
`--llama`, a Llama: RMSNorm, a gated SiLU MLP, 4 query heads sharing 2 key/value heads, an
untied head. With `--qwen2`, a Qwen2: Llama's layout with biases on Q, K and V alone, a tied
head, and a sliding window it does not use (`use_sliding_window = false`). With `--llama3`, a
Llama as Llama 3.2's are: a tied head, 4 query heads sharing one key/value head, base 500000 and
the `llama3` stretch of the rotary frequencies (its original context 256, so that within the
prompt one of each head's four frequencies is kept, one blended and two stretched). With
`--phi3`, a Phi-3: Q, K and V in one matrix and gate and up in another, 4 query heads sharing 2
key/value heads, half of each head rotated (`partial_rotary_factor = 0.5`), an untied head.

    python3 -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers tokenizers safetensors
    /tmp/hf/bin/python scripts/make-gpt2-fixture.py crates/ember-train/tests/fixtures/tiny-gpt2
    /tmp/hf/bin/python scripts/make-gpt2-fixture.py --neox crates/ember-train/tests/fixtures/tiny-neox
    /tmp/hf/bin/python scripts/make-gpt2-fixture.py --pythia crates/ember-train/tests/fixtures/tiny-pythia
    /tmp/hf/bin/python scripts/make-gpt2-fixture.py --llama crates/ember-train/tests/fixtures/tiny-llama
    /tmp/hf/bin/python scripts/make-gpt2-fixture.py --qwen2 crates/ember-train/tests/fixtures/tiny-qwen2
    /tmp/hf/bin/python scripts/make-gpt2-fixture.py --llama3 crates/ember-train/tests/fixtures/tiny-llama3
    /tmp/hf/bin/python scripts/make-gpt2-fixture.py --phi3 crates/ember-train/tests/fixtures/tiny-phi3

The output is committed, so the tests need no Python.
"""

import json
import sys
from pathlib import Path

import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

PROMPT = "ROMEO: What light through yonder window"
GREEDY_TOKENS = 16


def main(out: Path, kind: str) -> None:
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
    if kind == "llama":
        config = LlamaConfig(
            vocab_size=tok.get_vocab_size(),
            max_position_embeddings=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=48,
            hidden_act="silu",
            rms_norm_eps=1e-5,
            rope_theta=500.0,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = LlamaForCausalLM(config)
    elif kind == "llama3":
        config = LlamaConfig(
            vocab_size=tok.get_vocab_size(),
            max_position_embeddings=2048,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            intermediate_size=48,
            hidden_act="silu",
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
            tie_word_embeddings=True,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = LlamaForCausalLM(config)
    elif kind == "phi3":
        config = Phi3Config(
            vocab_size=tok.get_vocab_size(),
            max_position_embeddings=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=48,
            hidden_act="silu",
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 500.0,
                "partial_rotary_factor": 0.5,
            },
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        model = Phi3ForCausalLM(config)
    elif kind == "qwen2":
        config = Qwen2Config(
            vocab_size=tok.get_vocab_size(),
            max_position_embeddings=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=48,
            hidden_act="silu",
            rms_norm_eps=1e-6,
            rope_theta=500.0,
            tie_word_embeddings=True,
            use_sliding_window=False,
            sliding_window=16,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = Qwen2ForCausalLM(config)
    elif kind in ("neox", "pythia"):
        pythia = kind == "pythia"
        config = GPTNeoXConfig(
            vocab_size=tok.get_vocab_size(),
            max_position_embeddings=64,
            hidden_size=32,
            num_hidden_layers=2,
            # Pythia: heads of 16 dimensions, 4 of them turned.
            num_attention_heads=2 if pythia else 4,
            intermediate_size=96,
            hidden_act="gelu",
            use_parallel_residual=pythia,
            rotary_pct=0.25 if pythia else 1.0,
            rotary_emb_base=10000.0 if pythia else 500.0,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = GPTNeoXForCausalLM(config)
    else:
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
            if any(n in name for n in ("ln", "norm")) and name.endswith("weight"):
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
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    kinds = ("--neox", "--pythia", "--llama", "--llama3", "--phi3", "--qwen2")
    kind = next((a[2:] for a in sys.argv[1:] if a in kinds), "gpt2")
    default = f"crates/ember-train/tests/fixtures/tiny-{kind}"
    main(Path(args[0] if args else default), kind)
