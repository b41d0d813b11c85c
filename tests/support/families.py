"""Tiny random verifiers of every declared family, with a tokenizer and chat template of the family's own.

No family here ships a tokenizer in a package we can install (the hub is unreachable), so each gets a small
byte-level BPE tokenizer trained on the test conversations, carrying the family's real special tokens, and a chat
template written from the family's documented chat format (Llama 3's header tokens, ChatML with Qwen3's
``<think>`` history rule, OpenAI's harmony, Gemma 3's ``<start_of_turn>``, Gemma 4's ``<|turn>``, Mistral's tekken ``[INST]``, Granite's roles).
The model is built from the family's shipped ``config.json`` (``recipes/verifiers``), shrunk: the same model_type,
wrapper (``text_config``), layer-type pattern, MoE and multipliers, at hidden size 64 with 8 layers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from speculators import families
from speculators.atomic import atomic_directory
from tests.conftest import REPO_ROOT

SHIPPED = REPO_ROOT / "recipes" / "verifiers"

# The family's documented chat format, as a Jinja template (what its tokenizer_config.json would carry).
LLAMA3 = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set loop_messages = "
    "messages[1:] %}{%- else %}{%- set system = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023\\nToday Date: "
    "26 Jul 2024\\n\\n' + system + '<|eot_id|>' }}"
    "{%- for m in loop_messages %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content"
    " + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
CHATML_QWEN25 = (
    "{%- if messages[0].role != 'system' %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen3: an assistant turn before the last user message loses its <think> block; later ones keep it
CHATML_QWEN3 = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}{%- set reasoning = content.split('</think>')[0].split('<think>')[-1]"
    ".strip('\\n') %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# harmony: the model writes the channel header; a finished answer ends <|return|>, the same one in history
# <|end|>; the analysis message (field "thinking") is rendered for the last answer only
HARMONY = (
    "{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\nKnowledge "
    "cutoff: 2024-06\\n\\nReasoning: medium\\n\\n# Valid channels: analysis, commentary, final. Channel must be "
    "included for every message.<|end|>' }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}{{- '<|start|>developer<|message|># Instructions\\n\\n' + m.content + "
    "'<|end|>' }}"
    "{%- elif m.role == 'user' %}{{- '<|start|>user<|message|>' + m.content + '<|end|>' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- if loop.last and m.thinking is defined and m.thinking %}{{- '<|start|>assistant<|channel|>analysis"
    "<|message|>' + m.thinking + '<|end|>' }}{%- endif %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + m.content }}"
    "{{- '<|return|>' if loop.last else '<|end|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)
GEMMA4 = (
    "{{- bos_token }}"
    "{%- for m in messages %}{%- set role = 'model' if m.role == 'assistant' else m.role %}"
    "{{- '<|turn>' + role + '\\n' + m.content + '<turn|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|turn>model\\n' }}{%- endif %}"
)
# Gemma 3: no system role, the system message opens the first user turn
GEMMA3 = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set first = messages[0].content + '\\n\\n' %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set first = '' %}{%- set loop_messages = messages %}"
    "{%- endif %}"
    "{%- for m in loop_messages %}{%- set role = 'model' if m.role == 'assistant' else m.role %}"
    "{{- '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + m.content + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)
MISTRAL_V7 = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{{- '[SYSTEM_PROMPT]' + messages[0].content + '[/SYSTEM_PROMPT]' }}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for m in loop_messages %}"
    "{%- if m.role == 'user' %}{{- '[INST]' + m.content + '[/INST]' }}"
    "{%- elif m.role == 'assistant' %}{{- m.content + eos_token }}{%- endif %}"
    "{%- endfor %}"
)
GRANITE = (
    "{%- if messages[0].role != 'system' %}{{- '<|start_of_role|>system<|end_of_role|>Knowledge Cutoff Date: "
    "April 2024.\\nYou are Granite, developed by IBM. You are a helpful AI assistant.<|end_of_text|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}{{- '<|start_of_role|>' + m.role + '<|end_of_role|>' + m.content + "
    "'<|end_of_text|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}"
)


@dataclass(frozen=True)
class TinyFamily:
    """How the tests build one family's tiny verifier."""

    model_type: str
    template: str
    special: tuple[str, ...]  # the family's special tokens (control tokens of its chat format)
    plain: tuple[str, ...] = ()  # added but not special (Qwen's <think>: written inside answers)
    bos: str | None = None
    eos: str | None = None
    # settings of the shrunk text config beyond the common ones (MoE widths, windows, ...)
    shrink: tuple[tuple[str, Any], ...] = ()


TINY_FAMILIES: dict[str, TinyFamily] = {
    "llama": TinyFamily(
        "llama",
        LLAMA3,
        (
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|python_tag|>",
        ),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
    ),
    "qwen2": TinyFamily(
        "qwen2",
        CHATML_QWEN25,
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        ("<tool_call>", "</tool_call>"),
        eos="<|im_end|>",
    ),
    "qwen3": TinyFamily(
        "qwen3",
        CHATML_QWEN3,
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        ("<think>", "</think>", "<tool_call>", "</tool_call>"),
        eos="<|im_end|>",
    ),
    "qwen3_moe": TinyFamily(
        "qwen3_moe",
        CHATML_QWEN3,
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        ("<think>", "</think>", "<tool_call>", "</tool_call>"),
        eos="<|im_end|>",
        shrink=(("num_experts", 4), ("num_experts_per_tok", 2), ("moe_intermediate_size", 32)),
    ),
    "gpt_oss": TinyFamily(
        "gpt_oss",
        HARMONY,
        (
            "<|startoftext|>",
            "<|endoftext|>",
            "<|start|>",
            "<|end|>",
            "<|message|>",
            "<|channel|>",
            "<|constrain|>",
            "<|return|>",
            "<|call|>",
        ),
        bos="<|startoftext|>",
        eos="<|return|>",
        shrink=(
            ("num_local_experts", 4),
            ("num_experts_per_tok", 2),
            ("experts_per_token", 2),
            ("sliding_window", 512),
            ("quantization_config", None),
        ),
    ),
    "gemma4": TinyFamily(
        "gemma4",
        GEMMA4,
        ("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>"),
        bos="<bos>",
        eos="<turn|>",
        shrink=(
            ("sliding_window", 512),
            ("hidden_size_per_layer_input", 0),
            ("num_kv_shared_layers", 0),
            ("global_head_dim", 32),
            ("num_global_key_value_heads", 1),
            ("per_layer_config", None),
        ),
    ),
    "gemma3_text": TinyFamily(
        "gemma3_text",
        GEMMA3,
        ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
        bos="<bos>",
        eos="<end_of_turn>",
        shrink=(("sliding_window", 512),),
    ),
    "mistral3": TinyFamily(
        "mistral3",
        MISTRAL_V7,
        ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CALLS]"),
        bos="<s>",
        eos="</s>",
    ),
    "granite": TinyFamily(
        "granite",
        GRANITE,
        ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"),
        bos="<|end_of_text|>",
        eos="<|end_of_text|>",
    ),
}

# shape of every tiny text model: hidden 64, 8 layers, 2 heads of 32 (vLLM's CPU attention serves head size 32)
COMMON_SHRINK = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=1024,
)

# the conversations every family's tokenizer is trained on and its masks are checked with
CONVERSATIONS = [
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome is the capital of Italy."},
    ],
    [
        {"role": "user", "content": "Name three prime numbers."},
        {"role": "assistant", "content": "Two, three and five are prime numbers."},
    ],
    [
        {"role": "user", "content": "Tell me a joke about the sea."},
        {"role": "assistant", "content": "Why is the sea so friendly? It always waves at you."},
    ],
]
EXTRA_TEXT = (
    "How do birds fly? Birds fly by flapping their wings. Explain rain to a child. Rain is water falling from "
    "clouds. Write a short poem about the sea. The sea is blue and wide. Hello! Who are you? I am a helpful "
    "assistant. Why did the chicken cross the road? To get to the other side. The user greets me."
)


def shipped_config(family: families.Family) -> dict[str, Any]:
    return json.loads((SHIPPED / family.reference_config).read_text())


def tiny_config_dict(model_type: str, vocab_size: int, init_std: float = 0.02) -> dict[str, Any]:
    """The family's shipped config.json with its text model shrunk (same keys, wrapper and layer pattern)."""
    family = families.get(model_type)
    config = shipped_config(family)
    wrapped = bool(family.text_config_key) and isinstance(config.get(family.text_config_key), dict)
    text = config[family.text_config_key] if wrapped else config
    pattern = text.get("layer_types")
    text.update(COMMON_SHRINK, vocab_size=vocab_size, initializer_range=init_std)
    for key, value in TINY_FAMILIES[model_type].shrink:
        if value is None:
            text.pop(key, None)
        else:
            text[key] = value
    if pattern:  # keep the family's mix of sliding and full layers, over 8 layers
        text["layer_types"] = [pattern[i % len(pattern)] for i in range(COMMON_SHRINK["num_hidden_layers"])]
        text["layer_types"][-1] = "full_attention"
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        for holder in (config, text):
            if isinstance(holder.get(key), int) and holder[key] >= vocab_size:
                holder[key] = vocab_size - 1
            elif isinstance(holder.get(key), list):
                holder[key] = [i if i < vocab_size else vocab_size - 1 for i in holder[key]]
    if wrapped:  # the vision tower: as small as its config allows
        config["initializer_range"] = init_std
        vision = config.get("vision_config") or {}
        vision.update(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1)
        if "head_dim" in vision:
            vision["head_dim"] = 32
        config.pop("audio_config", None)
        for key in (
            "image_token_index",
            "image_token_id",
            "boi_token_id",
            "eoi_token_id",
            "boa_token_id",
            "eoa_token_id",
            "audio_token_id",
            "video_token_id",
            "eov_token_id",
        ):
            if isinstance(config.get(key), int) and config[key] >= vocab_size:
                config[key] = vocab_size - 1
    config.pop("torch_dtype", None)
    config.pop("dtype", None)
    config.pop("quantization_config", None)
    return config


def family_tokenizer(model_type: str, vocab_size: int = 448):
    """A byte-level BPE tokenizer with the family's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tiny = TINY_FAMILIES[model_type]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(tiny.special) - len(tiny.plain),
        special_tokens=list(tiny.special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [m["content"] for chat in CONVERSATIONS for m in chat] + [EXTRA_TEXT]
    tokenizer.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=tiny.bos, eos_token=tiny.eos)
    fast.add_tokens(list(tiny.plain))
    fast.chat_template = tiny.template
    fast.pad_token = fast.eos_token
    return fast


def build_family_verifier(
    directory: str | Path, model_type: str, seed: int = 0, init_std: float = 0.3
) -> Path:
    """A random tiny verifier of ``model_type`` with its tokenizer, saved as an HF directory."""
    import transformers
    from transformers import AutoConfig

    tokenizer = family_tokenizer(model_type)
    settings = tiny_config_dict(model_type, vocab_size=512, init_std=init_std)
    config = AutoConfig.for_model(**settings)
    torch.manual_seed(seed)
    loader = getattr(transformers, families.get(model_type).auto_class)
    model = loader.from_config(config)
    with atomic_directory(directory) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    return Path(directory)
