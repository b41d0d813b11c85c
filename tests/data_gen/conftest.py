"""Fixtures for the data-generation tests: chat templates in three families on top of SmolLM2's tokenizer, tiny
conversation files, and a small data_gen config."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

# Llama-3.1-style: BOS, header tokens, a system block with dates, content trimmed, <|eot_id|> ends every turn.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# The same template with {% generation %} blocks around what the assistant emits (content + <|eot_id|>).
LLAMA3_TAGGED_TEMPLATE = LLAMA3_TEMPLATE.replace(
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}",
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}",
)

# Qwen3-style: <think> blocks are parsed out of the content, rendered for answers after the last user turn and
# DROPPED from earlier answers (so the whole conversation is not prefix-stable); enable_thinking=false pre-fills
# an empty think block in the generation prompt.
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_query_index=0) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'user' %}{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning_content = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def _with_tokens(tokenizer, special: list[str], plain: list[str], template: str, **attributes):
    from tokenizers import AddedToken

    tok = copy.deepcopy(tokenizer)
    if special:
        tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in special], special_tokens=True)
    if plain:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    for name, value in attributes.items():
        setattr(tok, name, value)
    tok.chat_template = template
    return tok


@pytest.fixture(scope="session")
def llama3_tokenizer(smollm2_tokenizer):
    return _with_tokens(
        smollm2_tokenizer,
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        [],
        LLAMA3_TEMPLATE,
        bos_token="<|begin_of_text|>",
    )


@pytest.fixture(scope="session")
def llama3_tagged_tokenizer(llama3_tokenizer):
    tok = copy.deepcopy(llama3_tokenizer)
    tok.chat_template = LLAMA3_TAGGED_TEMPLATE
    return tok


@pytest.fixture(scope="session")
def qwen3_tokenizer(smollm2_tokenizer):
    return _with_tokens(smollm2_tokenizer, [], ["<think>", "</think>"], QWEN3_TEMPLATE)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def chat_records(count: int, turns: int = 2, prefix: str = "c") -> list[dict]:
    """ShareGPT-layout conversations with varied lengths (deterministic)."""
    records = []
    for i in range(count):
        conversation = []
        for t in range(1 + i % turns):
            conversation.append(
                {"from": "human", "value": f"Question {i}.{t}: " + "tell me more " * (1 + (i * 7 + t) % 5)}
            )
            conversation.append(
                {"from": "gpt", "value": f"Answer {i}.{t}: " + "here is detail " * (1 + (i * 3 + t) % 6)}
            )
        records.append({"id": f"{prefix}{i:03d}", "conversations": conversation})
    return records
