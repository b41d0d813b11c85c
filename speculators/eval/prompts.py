"""Evaluation prompts: the shipped default set, data_gen's held-out split, or a user's chat JSONL.

One JSON object per line, in any of these layouts (the same ones data_gen reads):
  {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}      OpenAI (data_gen's held-out file)
  {"conversations": [{"from": "human"|"gpt"|"system", "value": str}, ...]}         ShareGPT
  {"prompt": str}                                                                    a single user turn
A conversation is cut after its LAST user message: the earlier turns are context, the verifier writes the reply.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from speculators.prompts import DEFAULT_PROMPTS

ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "chatgpt": "assistant",
    "model": "assistant",
}
HELDOUT_NAME = "heldout_conversations.jsonl"

Messages = list[dict[str, str]]


def resolve_prompt_file(path: str | Path | None) -> Path | None:
    """``None`` → the shipped set; a data_gen output directory → its held-out file; else the file itself."""
    if path is None:
        return None
    path = Path(path)
    if path.is_dir():
        if (path / HELDOUT_NAME).is_file():
            return path / HELDOUT_NAME
        raise FileNotFoundError(
            f"{path} is a directory without {HELDOUT_NAME}; pass a chat JSONL file instead"
        )
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    return path


def read_utf8(file: Path) -> str:
    """A prompt file's text; bytes that are not UTF-8 are named by line, with the fix."""
    data = file.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ValueError(
            f"{file}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x}); re-encode the file as UTF-8"
        ) from exc


def load_prompts(path: str | Path | None = None, limit: int | None = None) -> list[Messages]:
    """Chat prompts (message lists ending with a user turn) from ``path`` or the shipped default set."""
    file = resolve_prompt_file(path)
    if file is None:
        text = resources.files("speculators.prompts").joinpath(DEFAULT_PROMPTS).read_text()
        where = f"speculators/prompts/{DEFAULT_PROMPTS}"
    else:
        text, where = read_utf8(file), str(file)
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{where}:{number}: not valid JSON ({exc.msg}); write one JSON object per line"
            ) from exc
        prompts.append(_prompt_messages(record, f"{where}:{number}"))
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise ValueError(f"{where} holds no prompts")
    return prompts


def _prompt_messages(record: Any, where: str) -> Messages:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object with 'messages', 'conversations' or 'prompt'")
    if isinstance(record.get("prompt"), str):
        return [{"role": "user", "content": record["prompt"]}]
    if isinstance(record.get("messages"), list):
        messages = [_message(m, "role", "content", where) for m in record["messages"]]
    elif isinstance(record.get("conversations"), list):
        messages = [_message(m, "from", "value", where) for m in record["conversations"]]
    else:
        raise ValueError(
            f"{where}: no 'messages' (OpenAI), 'conversations' (ShareGPT) or 'prompt' field; keys: {sorted(record)}"
        )
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise ValueError(f"{where}: the conversation has no user message to answer")
    return messages[: users[-1] + 1]


def _message(raw: Any, role_key: str, content_key: str, where: str) -> dict[str, str]:
    if not isinstance(raw, dict) or role_key not in raw or content_key not in raw:
        raise ValueError(f"{where}: each message needs '{role_key}' and '{content_key}'")
    role = ROLES.get(str(raw[role_key]).lower())
    if role is None:
        raise ValueError(f"{where}: unknown role {raw[role_key]!r} (use system, user or assistant)")
    content = raw[content_key]
    if isinstance(content, list):  # OpenAI content parts
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return {"role": role, "content": str(content)}


def render_prompts(tokenizer: Any, prompts: list[Messages]) -> list[list[int]]:
    """Token ids with the verifier's chat template and the assistant generation prompt appended."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the verifier's tokenizer has no chat template; evaluation prompts are chats — use a chat model's "
            "tokenizer (or add a chat_template to tokenizer_config.json)"
        )
    rendered = []
    for messages in prompts:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # newer tokenizers return a BatchEncoding
            ids = ids["input_ids"]
        rendered.append([int(i) for i in ids])
    return rendered


def fit_chat(
    tokenizer: Any, chat: Messages, max_prompt_tokens: int | None, shorten: bool = True
) -> tuple[list[int], Messages] | None:
    """``(ids, chat)`` of ``chat`` cut back to its latest user turn whose rendering fits ``max_prompt_tokens``
    (only the whole chat with ``shorten=False``: a benchmark turn must not turn into another one), or None."""
    ends = [i + 1 for i, m in enumerate(chat) if m["role"] == "user"][::-1]  # longest prefix first
    for end in ends if shorten else ends[:1]:
        ids = render_prompts(tokenizer, [chat[:end]])[0]
        if max_prompt_tokens is None or len(ids) <= max_prompt_tokens:
            return ids, chat[:end]
    return None


def select_prompts(
    tokenizer: Any, conversations: list[Messages], max_prompt_tokens: int | None, limit: int | None
) -> tuple[list[list[int]], list[Messages], dict[str, int]]:
    """Render the prompts, keeping the first ``limit`` that fit ``max_prompt_tokens`` (ids, chats, counts).

    A multi-turn chat longer than the cap is cut back to its latest user turn that fits (``shortened``); one whose
    first user turn alone is too long is left out (``skipped``). Held-out ShareGPT chats run to thousands of
    tokens: a draft trained on 512-token samples is measured on prompts of the length it learned, and prefill
    stays out of a CPU evaluation's way."""
    ids_kept, chats_kept, counts = [], [], {"shortened": 0, "skipped": 0}
    for chat in conversations:
        if limit and len(chats_kept) >= limit:
            break
        fitted = fit_chat(tokenizer, chat, max_prompt_tokens)
        if fitted is None:
            counts["skipped"] += 1
            continue
        ids_kept.append(fitted[0])
        chats_kept.append(fitted[1])
        counts["shortened"] += len(fitted[1]) != len(chat)
    if not chats_kept:
        raise ValueError(
            f"none of the {len(conversations)} prompts fits {max_prompt_tokens} tokens, even cut to its first user "
            "turn; raise --max-prompt-tokens"
        )
    return ids_kept, chats_kept, counts
