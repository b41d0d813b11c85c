"""Served traffic as a data source: a draft adapted to the requests its verifier actually serves.

A log is JSONL, one served request per line, in any of these shapes (``data.format: served``; ``auto`` picks it
when the file's first record is one):

  OpenAI pair    {"request": {"model", "messages", "temperature"?, …}, "response": {chat completion}}
                 {"messages": [...], "response": {chat completion}}
                 {"messages": [...], "choices": [...], "model", "created", "temperature"?, …}
  eval rows      the rows of ``speculators eval --keep-texts``' requests.jsonl ("messages", "output_text", …)
  bare prompts   {"prompt": str, "created"?, "model"?} or {"messages": [...]} ending in a user turn

The conversation is the request's messages plus the answer served (``choices[0].message``); a served answer is the
verifier's own, so it is kept as is (on-policy), and one cut at ``max_tokens`` (``finish_reason: "length"``) is
marked ``"truncated"`` so the masker keeps the end-of-turn token the verifier never emitted out of the loss. A bare
prompt has no answer: it is kept only with ``data_gen.regenerate.enabled`` (the regenerator writes the verifier's
answer in place of :data:`PLACEHOLDER`), and refused otherwise, so a placeholder is never trained on.

What the log says beside the turns is kept: ``created`` (Unix time; the response's, else the record's), which
``data.heldout_by: time`` orders by, and the sampling temperature, counted in the report.

A malformed line (not an object, no choices, an answer that is not text, a bad ``created``…), a line served by
another model than this verifier, or an eval row recorded without texts is ALWAYS an error (:class:`TrafficError`)
naming the file and the line, whatever ``data.on_invalid`` says: a log is the user's record of what happened, and
silently dropping part of it would skew the window. Only what every source may drop (an empty turn, an unknown
role, a non-text part of a prompt) follows ``data.on_invalid``; :mod:`data_gen.sources` normalises the turns, drops
duplicates and builds the conversations. This module reads lines and imports nothing of data_gen's.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PLACEHOLDER = "(no answer was served: data_gen.regenerate writes the verifier's answer here)"
EVAL_ROW_KEYS = (
    "engine",
    "run",
    "accepted_per_step",
)  # what marks a row of speculators eval's requests.jsonl
EVAL_TEXT_KEYS = ("messages", "output_text")
PAIR_KEYS = ("request", "response", "choices")
TURN_KEYS = ("messages", "conversations", "data")  # a chat dataset's turns: a "prompt" beside them is no log


class TrafficError(ValueError):
    """A served log, or one of its lines, that cannot be read as served requests: always refused."""


@dataclass
class Served:
    """One served request as logged: the request's turns (as written) and the answer, and what the log says."""

    turns: list[dict[str, Any]]  # the request's messages, each an object (roles and parts not normalised yet)
    answer: str | None  # None: a bare prompt, answered by regeneration
    created: float | None = None
    model: str | None = None
    temperature: float | None = None
    response_id: str | None = None
    finish_reason: str | None = None

    def messages(self) -> list[dict[str, Any]]:
        """The turns and the answer (or :data:`PLACEHOLDER`) as one chat."""
        return [
            *self.turns,
            {"role": "assistant", "content": PLACEHOLDER if self.answer is None else self.answer},
        ]


# ---- recognising and reading a log -------------------------------------------------------------------------------
def is_served_record(record: Any) -> bool:
    """Whether ``record`` is a served request (see the module docstring), not a chat dataset's record."""
    if not isinstance(record, dict):
        return False
    if all(key in record for key in EVAL_ROW_KEYS):
        return True
    if any(record.get(key) is not None for key in PAIR_KEYS):
        return True
    return isinstance(record.get("prompt"), str) and all(record.get(key) is None for key in TURN_KEYS)


def is_served_file(path: Path) -> bool:
    """Whether ``path`` is a JSONL file whose first record is a served request (a log is one layout)."""
    if path.suffix.lower() != ".jsonl" or not path.is_file():
        return False
    with open(path, "rb") as handle:
        for raw in handle:
            if raw.strip():
                try:
                    return is_served_record(json.loads(raw))
                except (json.JSONDecodeError, UnicodeDecodeError):
                    return False  # the chat reader names the line
    return False


def log_lines(source: str) -> list[tuple[int, Any]]:
    """``(line number, parsed line)`` of the log, blank lines skipped; an unreadable line is refused."""
    path = Path(source).expanduser()
    if not path.is_file():
        raise TrafficError(f"data.source={source!r} is not a file; give the JSONL log of served requests")
    lines = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if raw.strip():
                lines.append((number, parse_line(raw, f"{source} line {number}")))
    if not lines:
        raise TrafficError(f"{source} is empty; give data.source a log with served requests in it")
    return lines


def parse_line(raw: bytes, where: str) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise TrafficError(
            f"{where}: not UTF-8 text (byte at position {error.start + 1}); re-encode the log as UTF-8"
        ) from None
    except json.JSONDecodeError as error:
        raise TrafficError(
            f"{where}: not valid JSON ({error.msg} at column {error.colno}); fix or remove that line"
        ) from None


# ---- one served record ---------------------------------------------------------------------------------------------
def parse_served(record: Any) -> Served:
    """The request and answer of one log line; :class:`TrafficError` when its shape is not a served one."""
    if not isinstance(record, dict):
        raise TrafficError(f"a {type(record).__name__}, not a JSON object")
    if all(key in record for key in EVAL_ROW_KEYS):
        return parse_eval_row(record)
    if record.get("request") is not None:
        request = _object(record["request"], "'request'")
        return parse_pair(record, request, _object(record.get("response"), "'response'"))
    if record.get("response") is not None:
        return parse_pair(record, record, _object(record["response"], "'response'"))
    if record.get("choices") is not None:
        return parse_pair(record, record, record)
    return parse_prompt(record)


def _object(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        shown = "missing" if value is None else f"a {type(value).__name__}"
        raise TrafficError(f"{name} is {shown}, not an object")
    return value


def parse_pair(record: dict[str, Any], request: dict[str, Any], response: dict[str, Any]) -> Served:
    """A chat-completions request and its response (the two may be one object: the flat layout)."""
    answer, finish_reason = completion_answer(response)
    return Served(
        turns=request_turns(request),
        answer=answer,
        created=unix_time(response.get("created"), record.get("created")),
        model=model_name(response.get("model"), request.get("model"), record.get("model")),
        temperature=temperature_of(request.get("temperature"), record.get("temperature")),
        response_id=_optional_id(response.get("id"), record.get("id")),
        finish_reason=finish_reason,
    )


def parse_eval_row(record: dict[str, Any]) -> Served:
    """A row of ``speculators eval``'s requests.jsonl: the texts are there only with ``--keep-texts``."""
    if any(record.get(key) is None for key in EVAL_TEXT_KEYS):
        raise TrafficError(
            "a `speculators eval` request row without texts (no 'messages' / 'output_text'); rerun eval with "
            "--keep-texts to record the prompts and outputs"
        )
    return Served(
        turns=request_turns(record),
        answer=answer_text(record["output_text"], "'output_text'"),
        created=unix_time(record.get("created")),
        model=model_name(record.get("model")),
        temperature=temperature_of(record.get("temperature")),
        finish_reason=_optional_str(record.get("finish_reason"), "'finish_reason'"),
    )


def parse_prompt(record: dict[str, Any]) -> Served:
    """A bare prompt (``prompt`` text, or ``messages`` ending in a user turn), or an answered chat logged as
    ``messages`` alone (its last turn the answer)."""
    if record.get("messages") is not None:
        turns = request_turns(record)
    elif isinstance(record.get("prompt"), str):
        turns = [{"role": "user", "content": record["prompt"]}]
    else:
        raise TrafficError(
            f"not a served request: no 'request', 'response', 'choices', 'messages' or 'prompt' "
            f"(keys: {sorted(record)[:8]})"
        )
    answer = None
    if turns and turns[-1].get("role") == "assistant":
        answer = answer_text(turns[-1].get("content"), "the last message")
        turns = turns[:-1]
    return Served(
        turns=turns,
        answer=answer,
        created=unix_time(record.get("created")),
        model=model_name(record.get("model")),
        temperature=temperature_of(record.get("temperature")),
        response_id=_optional_id(record.get("id")),
    )


def request_turns(request: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's messages, each an object (their roles and parts are normalised as every chat's are)."""
    turns = request.get("messages")
    if not isinstance(turns, list):
        raise TrafficError("the request has no 'messages' list")
    for turn in turns:
        if not isinstance(turn, dict):
            raise TrafficError(f"a request message is a {type(turn).__name__}, not an object")
    return turns


def completion_answer(response: dict[str, Any]) -> tuple[str, str | None]:
    """The text and finish reason of the first choice of a chat completion."""
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        raise TrafficError("the response has no 'choices'")
    choice = _object(choices[0], "choices[0]")
    message = _object(choice.get("message"), "choices[0].message")
    if message.get("role", "assistant") != "assistant":
        raise TrafficError(f"choices[0].message has role {message.get('role')!r}, not 'assistant'")
    text = answer_text(message.get("content"), "choices[0].message's content")
    return text, _optional_str(choice.get("finish_reason"), "choices[0].finish_reason")


def answer_text(content: Any, name: str) -> str:
    """An answer as text: a string, or OpenAI text parts joined (anything else is not an answer to train on)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    kind = "none" if content is None else f"a {type(content).__name__}"
    raise TrafficError(f"{name} is {kind}, not text (a tool call or an image?)")


def unix_time(*candidates: Any) -> float | None:
    """The first present candidate as a Unix time in seconds."""
    value = _first(candidates)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise TrafficError(f"'created' is {value!r}, not a Unix time in seconds")
    return float(value)


def model_name(*candidates: Any) -> str | None:
    return _optional_str(_first(candidates), "'model'")


def temperature_of(*candidates: Any) -> float | None:
    value = _first(candidates)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise TrafficError(f"'temperature' is {value!r}, not a sampling temperature")
    return float(value)


def _first(candidates: Sequence[Any]) -> Any:
    return next((c for c in candidates if c is not None), None)


def _optional_str(value: Any, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TrafficError(f"{name} is a {type(value).__name__}, not text")
    return value


def _optional_id(*candidates: Any) -> str | None:
    value = next((c for c in candidates if c not in (None, "")), None)
    return None if value is None else str(value)


def temperature_key(temperature: float | None) -> str:
    """A temperature as the report counts it (``unknown`` when the log does not say)."""
    return "unknown" if temperature is None else f"{temperature:g}"


# ---- whose traffic -----------------------------------------------------------------------------------------------
def check_model(model: str | None, verifier: str | None, served_model: str | None, where: str) -> None:
    """Refuse a request served by another model: its answers are not this verifier's, so a draft trained on them
    would learn another model's distribution. Without a ``model`` field (or a name to compare with) it passes."""
    if model is None or (verifier is None and served_model is None):
        return
    if served_model is not None:
        names = {served_model}
    else:
        names = {verifier, verifier.rstrip("/").rsplit("/", 1)[-1]}
    if model not in names:
        shown = served_model if served_model is not None else verifier
        raise TrafficError(
            f"{where}: served by {model!r}, not this verifier {shown!r}; keep only this verifier's traffic, or set "
            "data.served_model=<name> if that is the name it is served under"
        )


def check_answered(served: Served, regenerate: bool, where: str) -> None:
    """A bare prompt is kept only when regeneration writes its answer; otherwise its placeholder would be trained
    on."""
    if served.answer is None and not regenerate:
        raise TrafficError(
            f"{where}: a prompt without a served answer; set data_gen.regenerate.enabled=true to have the "
            "verifier answer such prompts, or give a log with the answers"
        )


def content_hash(messages: list[dict[str, Any]]) -> str:
    """What makes two conversations the same one: every turn, the answer included."""
    return hashlib.sha256(json.dumps(messages, ensure_ascii=False, sort_keys=True).encode()).hexdigest()


# ---- a window of traffic -----------------------------------------------------------------------------------------
def window_summary(conversations: Sequence[Any]) -> dict[str, Any]:
    """What identifies a window of conversations (``id``, ``messages``, ``created``) without holding any of their
    text: its size, time range, and a sha256 over the ordered ids and contents (the same window hashes the same in
    every run; one changed turn changes it)."""
    digest = hashlib.sha256()
    for conversation in conversations:
        line = json.dumps([conversation.id, conversation.messages], ensure_ascii=False, sort_keys=True)
        digest.update(line.encode() + b"\n")
    times = [c.created for c in conversations if c.created is not None]
    return {
        "count": len(conversations),
        "first_created": min(times, default=None),
        "last_created": max(times, default=None),
        "sha256": digest.hexdigest(),
    }


__all__ = [
    "PLACEHOLDER",
    "Served",
    "TrafficError",
    "check_answered",
    "check_model",
    "is_served_file",
    "is_served_record",
    "log_lines",
    "parse_served",
    "window_summary",
]
