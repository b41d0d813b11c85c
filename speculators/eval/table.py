"""The evaluation as a table of requests: each decoded request recorded once, every report a function of the table.

Why a table: per-domain, per-prompt-length and per-k views of one evaluation must agree with each other and with
the headline numbers, and a later question ("how does acceptance fall with context length?") must be answerable
from the file without decoding again. So ``speculators eval`` writes ``requests.jsonl`` (one :class:`Request` per
line, atomically) beside ``results.json``, and ``results.json``'s per-run summaries and per-suite reports are
computed from those rows by the pure functions here.

A row holds the raw counters, not rates: the accepted drafts of every verify step (``accepted_per_step``; vLLM's
``per_step_accepted`` with ``--per-request-spec-decode-metrics detailed``), the drafts proposed at each step, and
the timings of the batch the request ran in (shared by its rows: ``batch`` says which rows shared it).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from speculators.atomic import atomic_write_text
from speculators.decoding.metrics import DecodingStats

REQUESTS_NAME = "requests.jsonl"
LENGTH_EDGES = (128, 256, 512, 1024, 2048, 4096)  # prompt-token bucket boundaries


@dataclass
class BatchTiming:
    """What one decoded batch cost; every request of the batch carries the same copy."""

    wall_s: float = 0.0
    prefill_s: float = 0.0
    verifier_s: float = 0.0
    draft_s: float = 0.0
    verifier_forwards: int = 0
    draft_forwards: int = 0


@dataclass
class Request:
    """One request decoded by one engine configuration: where it came from and what was counted."""

    request: int  # index into the evaluation's prompt list (the same across engines)
    suite: str
    category: str
    prompt_id: str
    turn: int
    prompt_tokens: int
    output_tokens: int
    engine: str  # "ours", "oracle", "vllm" or "plain"
    run: str  # e.g. "chain-k3", "plain"
    method: str  # "chain", "tree" or "plain"
    k: int  # drafts per step (0 for plain decoding)
    concurrency: int  # requests decoded together (our batch size)
    batch: int  # which rows shared ``timing``
    accepted_per_step: list[int] = field(default_factory=list)
    drafted_per_step: list[int] = field(default_factory=list)
    timing: BatchTiming = field(default_factory=BatchTiming)

    @property
    def verify_steps(self) -> int:
        return len(self.accepted_per_step)

    def accepted_per_position(self) -> list[int]:
        """Verify steps in which the draft at position j+1 was accepted (a chain's drafts 1..j+1 all were)."""
        return [sum(count > j for count in self.accepted_per_step) for j in range(self.k)]

    def to_json(self) -> dict[str, Any]:
        row = asdict(self)
        row["verify_steps"] = self.verify_steps
        row["accepted_per_position"] = self.accepted_per_position()
        return row

    @classmethod
    def from_json(cls, row: dict[str, Any], where: str = "requests.jsonl") -> Request:
        names = {f.name for f in fields(cls)}
        missing = sorted(names - set(row))
        if missing:
            raise ValueError(
                f"{where}: request row lacks {missing}; it was not written by `speculators eval`"
            )
        values = {name: row[name] for name in names}
        values["timing"] = BatchTiming(**row["timing"])
        return cls(**values)


def write_requests(rows: Iterable[Request], path: Path) -> None:
    """``requests.jsonl`` written atomically (speculators.atomic): a reader never sees a half-written table, and an
    interrupted run leaves the previous one."""
    atomic_write_text(path, "".join(json.dumps(row.to_json()) + "\n" for row in rows))


def read_requests(path: Path) -> list[Request]:
    """The rows of a ``requests.jsonl``, with the line named when one is unreadable."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if line.strip():
            try:
                rows.append(Request.from_json(json.loads(line), f"{path}:{number}"))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg})") from exc
    return rows


# ---- reports: pure functions of the rows ------------------------------------------------------------------------
def as_stats(rows: list[Request]) -> DecodingStats:
    """The rows as the engine's own :class:`DecodingStats` (each batch's timing counted once), so a summary of the
    table is exactly the summary every other report in the project uses."""
    batches: dict[int, BatchTiming] = {}
    for row in rows:
        batches.setdefault(row.batch, row.timing)
    return DecodingStats(
        max_depth=max((row.k for row in rows), default=0),
        accepted=[list(row.accepted_per_step) for row in rows],
        generated=[row.output_tokens for row in rows],
        wall_s=sum(b.wall_s for b in batches.values()),
        prefill_s=sum(b.prefill_s for b in batches.values()),
        verifier_s=sum(b.verifier_s for b in batches.values()),
        draft_s=sum(b.draft_s for b in batches.values()),
        verifier_forwards=sum(b.verifier_forwards for b in batches.values()),
        draft_forwards=sum(b.draft_forwards for b in batches.values()),
    )


TIMING_KEYS = (
    "tokens_per_s",
    "decode_tokens_per_s",
    "wall_s",
    "prefill_s",
    "verifier_s",
    "draft_s",
    "verifier_forwards",
    "draft_forwards",
)


def summarize(rows: list[Request], timed: bool = True) -> dict[str, Any]:
    """Acceptance length, tokens per verify step and conditional per-position acceptance of ``rows``.

    ``tokens_per_verify_step`` is what the user got per verifier call: output tokens ÷ (verify steps + the prefill),
    lower than the acceptance length where accepted tokens past EOS or the token limit were dropped. ``timed=False``
    leaves the timings out, for groups that share batches with other groups (a batch's time is not theirs)."""
    summary = as_stats(rows).summary()
    if not timed:
        summary = {key: value for key, value in summary.items() if key not in TIMING_KEYS}
    steps = sum(row.verify_steps for row in rows)
    summary["num_requests"] = len(rows)
    summary["prompt_tokens_mean"] = sum(row.prompt_tokens for row in rows) / len(rows) if rows else None
    summary["tokens_per_verify_step"] = (
        sum(row.output_tokens for row in rows) / (steps + len(rows)) if rows else None
    )
    return summary


def length_bucket(prompt_tokens: int) -> str:
    """The context-length bucket of a prompt: ``"<128"``, ``"128-255"``, …, ``">=4096"``."""
    low = 0
    for edge in LENGTH_EDGES:
        if prompt_tokens < edge:
            return f"<{edge}" if low == 0 else f"{low}-{edge - 1}"
        low = edge
    return f">={LENGTH_EDGES[-1]}"


def group(rows: list[Request], key: Callable[[Request], Any]) -> dict[Any, list[Request]]:
    """Rows by ``key``, in first-seen order."""
    out: dict[Any, list[Request]] = defaultdict(list)
    for row in rows:
        out[key(row)].append(row)
    return dict(out)


def run_reports(rows: list[Request]) -> dict[str, Any]:
    """One run's views: overall, per suite, per suite/category, per prompt-length bucket."""
    return {
        "overall": summarize(rows),
        "per_suite": {suite: summarize(part) for suite, part in group(rows, lambda r: r.suite).items()},
        "per_category": {
            f"{suite}/{category}": summarize(part, timed=False)
            for (suite, category), part in group(rows, lambda r: (r.suite, r.category)).items()
        },
        "per_prompt_length": {
            bucket: summarize(part, timed=False)
            for bucket, part in sorted(
                group(rows, lambda r: length_bucket(r.prompt_tokens)).items(),
                key=lambda kv: _bucket_order(kv[0]),
            )
        },
    }


def _bucket_order(bucket: str) -> int:
    digits = "".join(ch if ch.isdigit() else " " for ch in bucket).split()
    return int(digits[0]) if digits and not bucket.startswith("<") else -1


def reports(rows: list[Request]) -> dict[str, Any]:
    """Every report of the evaluation, keyed ``engine/run`` (e.g. ``ours/chain-k3``), plus a per-k table of each
    engine. A pure function of the rows: recomputing it from ``requests.jsonl`` gives results.json's numbers."""
    drafted = [row for row in rows if row.k > 0]
    by_run = group(drafted, lambda r: f"{r.engine}/{r.run}")
    chains = [row for row in drafted if row.method == "chain"]
    per_k = {
        f"{engine}/k{k}/c{concurrency}": summarize(part)
        for (engine, k, concurrency), part in group(chains, lambda r: (r.engine, r.k, r.concurrency)).items()
    }
    return {
        "runs": {name: run_reports(part) for name, part in by_run.items()},
        "per_k": per_k,
        "k_sweep": k_sweep(rows),
    }


def k_sweep(rows: list[Request]) -> dict[str, Any]:
    """Our engine's chains by concurrency and k: tokens/s and acceptance length of each point, the k with the most
    tokens/s at each concurrency (``best_k``, keyed by concurrency as a string: JSON keys) — the k to serve — and,
    where plain decoding ran at that concurrency (``plain_tokens_per_s``), each point's ``speedup`` over it: the
    figure a user compares, since a batch raises plain decoding's tokens/s as well as the draft's."""
    chains = [row for row in rows if row.engine == "ours" and row.method == "chain"]
    plain = {
        str(concurrency): as_stats(part).summary()["tokens_per_s"]
        for concurrency, part in sorted(
            group([row for row in rows if row.engine == "plain"], lambda r: r.concurrency).items()
        )
    }
    points = []
    for (concurrency, k), part in sorted(group(chains, lambda r: (r.concurrency, r.k)).items()):
        summary = as_stats(part).summary()
        base = plain.get(str(concurrency))
        points.append(
            {
                "concurrency": concurrency,
                "k": k,
                "tokens_per_s": summary["tokens_per_s"],
                "speedup": summary["tokens_per_s"] / base if base and summary["tokens_per_s"] else None,
                "acceptance_length": summary.get("acceptance_length_global"),
                "requests": len(part),
            }
        )
    best: dict[str, int] = {}
    for concurrency in sorted({p["concurrency"] for p in points}):
        at = [p for p in points if p["concurrency"] == concurrency and p["tokens_per_s"] is not None]
        if at:
            best[str(concurrency)] = max(at, key=lambda p: p["tokens_per_s"])["k"]
    return {"points": points, "best_k": best, "plain_tokens_per_s": plain}
