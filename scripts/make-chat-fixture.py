#!/usr/bin/env python3
"""Makes the chat-template fixture that ember's template rendering is tested against: three
templates written for the test in the styles models ship (ChatML's turns; a Llama-3-like header
per turn with a system message pulled out and today's date; a template that checks the turns'
order with `raise_exception`, uses `namespace`, loop variables and Python string methods), each
rendered by transformers' `apply_chat_template` for several conversations, with and without the
generation prompt. Today's date is written as `{DATE}` (the test puts in its own day's).

    python3 -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers tokenizers
    /tmp/hf/bin/python scripts/make-chat-fixture.py crates/ember-data/tests/fixtures/chat.json

The output is committed, so the tests need no Python.
"""

import datetime
import json
import sys
from pathlib import Path

import transformers
from transformers import PreTrainedTokenizerFast

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

HEADERS = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "1 Jan 2000" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = "" %}
{%- endif %}
{{- "<|header|>system<|end_header|>\\n\\n" }}
{{- "Today: " + date_string + "\\n\\n" }}
{{- system }}
{{- "<|turn_end|>" }}
{%- for message in messages %}
    {{- '<|header|>' + message['role'] + '<|end_header|>\\n\\n' + message['content'] | trim + '<|turn_end|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|header|>assistant<|end_header|>\\n\\n' }}
{%- endif %}
"""

ORDERED = """{% set ns = namespace(turns=0, system=false) %}
{% for message in messages %}
    {% if message.role == 'system' %}
        {% if not loop.first %}{{ raise_exception('only the first message may be a system message') }}{% endif %}
        {% set ns.system = true %}
[SYS] {{ message.content.strip() }}
    {% else %}
        {% if (message.role == 'user') != ((loop.index0 - (1 if ns.system else 0)) % 2 == 0) %}
            {{ raise_exception('turns must go user, assistant, user, ...') }}
        {% endif %}
        {% set ns.turns = ns.turns + 1 %}
{{ message.role.upper() }} {{ ns.turns }}: {{ message.content.replace('\\n', ' ') }}{% if message.role == 'assistant' %}{{ eos_token }}{% endif %}
        {% if loop.last and message.content.startswith('?') %}(ends in a question){% endif %}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}ASSISTANT {{ ns.turns + 1 }}:{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [
        {"role": "system", "content": "  You answer briefly.  "},
        {"role": "user", "content": "What is a transformer?\nIn one line."},
    ],
    [
        {"role": "user", "content": "Name a colour"},
        {"role": "assistant", "content": "Blue"},
        {"role": "user", "content": "?Another"},
    ],
    [{"role": "assistant", "content": "I start"}, {"role": "user", "content": "No"}],
    [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Late"}],
]


def main(out: Path) -> None:
    tok_file = Path(__file__).resolve().parent.parent / "crates/ember-train/tests/fixtures/tiny-llama/tokenizer.json"
    today = datetime.datetime.now().strftime("%d %b %Y")
    cases = []
    for name, template in [("chatml", CHATML), ("headers", HEADERS), ("ordered", ORDERED)]:
        tok = PreTrainedTokenizerFast(tokenizer_file=str(tok_file), bos_token="<s>", eos_token="</s>")
        tok.chat_template = template
        for messages in CONVERSATIONS:
            for generation in (True, False):
                case = {
                    "template": name,
                    "messages": messages,
                    "add_generation_prompt": generation,
                }
                try:
                    text = tok.apply_chat_template(
                        messages, tokenize=False, add_generation_prompt=generation
                    )
                    case["expected"] = text.replace(today, "{DATE}")
                except Exception as e:  # the template's raise_exception
                    case["error"] = str(e)
                cases.append(case)
    fixture = {
        "made_with": {"transformers": transformers.__version__},
        "bos_token": "<s>",
        "eos_token": "</s>",
        "templates": {"chatml": CHATML, "headers": HEADERS, "ordered": ORDERED},
        "cases": cases,
    }
    out.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {out}: {len(cases)} cases")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "crates/ember-data/tests/fixtures/chat.json"))
