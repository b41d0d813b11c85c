"""Decoding into the request table: every batch's requests become :class:`~speculators.eval.table.Request` rows.

``speculators eval`` decodes through here (plain baseline, each draft run, the oracle ceiling, the k × concurrency
sweep) and adds vLLM's per-request counters to the same table; its reports are then computed from the rows
(:mod:`speculators.eval.table`). Batches never mix suites, so each suite's tokens/s is its own.

With ``--keep-texts`` (:class:`TextKeeper`) each row also carries the prompt chat, the decoded output, the
verifier's name, the time and the sampling settings (:class:`TextRequest`), so the table doubles as a served-traffic
log that ``data_gen`` reads (:mod:`data_gen.traffic`). Off by default: the texts of users' prompts are not copied
into a results directory unasked.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from speculators.decoding.engine import GenerationResult
from speculators.eval.suites import PromptLabel
from speculators.eval.table import BatchTiming, Request


@dataclass(frozen=True)
class RunSpec:
    """Which engine configuration a set of rows comes from."""

    engine: str  # "ours", "oracle", "plain", "vllm"
    run: str  # "chain-k3", "oracle-k3", "plain", "chain-k3@c1"
    method: str  # "chain", "tree", "plain"
    k: int  # drafts per step (0: no draft)
    drafted: int  # drafted tokens per verify step (k for a chain, the budget for a tree)


@dataclass
class TextRequest(Request):
    """A request row with its texts (``--keep-texts``): a served-traffic record as well as a measurement. The extra
    fields follow the served logs' names (OpenAI ``messages``, ``model``, ``created``), so data_gen reads the rows as
    it reads a gateway's log; :meth:`Request.from_json` reads them back as plain rows."""

    messages: list[dict[str, str]] = field(default_factory=list)  # the prompt chat, OpenAI layout
    output_text: str = ""  # the decoded output
    model: str = ""  # the verifier's name_or_path as eval was given it
    created: float = 0.0  # Unix time the row was made
    temperature: float = 0.0
    finish_reason: str = "stop"  # "length": cut at --max-new-tokens, no end of turn emitted


@dataclass
class TextKeeper:
    """What ``--keep-texts`` adds to each row, and from what: the prompt chats in request order, the tokenizer's
    decode, the verifier's name and the stop ids (an output ending in one stopped; else it was cut)."""

    conversations: Sequence[list[dict[str, str]]]
    decode: Callable[[Sequence[int]], str]
    model: str
    temperature: float
    stop: frozenset[int]

    def with_texts(self, row: Request, output: Sequence[int]) -> TextRequest:
        stopped = bool(output) and int(output[-1]) in self.stop
        return TextRequest(
            **{f.name: getattr(row, f.name) for f in fields(Request)},
            messages=[dict(m) for m in self.conversations[row.request]],
            output_text=self.decode(list(output)),
            model=self.model,
            created=time.time(),
            temperature=self.temperature,
            finish_reason="stop" if stopped else "length",
        )


@dataclass
class RequestLog:
    """The rows of one evaluation, with batch ids unique across all its runs; ``texts``: keep each row's texts."""

    rows: list[Request] = field(default_factory=list)
    _batches: Any = field(default_factory=itertools.count, repr=False)
    texts: TextKeeper | None = None

    def record(self, row: Request, output: Sequence[int]) -> Request:
        """``row`` as the table keeps it: with its texts when they are kept."""
        return row if self.texts is None else self.texts.with_texts(row, output)

    def next_batch(self) -> int:
        return next(self._batches)

    def of_run(self, engine: str, run: str) -> list[Request]:
        return [row for row in self.rows if row.engine == engine and row.run == run]


def suite_batches(labels: Sequence[PromptLabel], size: int) -> list[list[int]]:
    """Prompt indices in batches of at most ``size`` that never mix suites (consecutive prompts of one suite)."""
    if size < 1:
        raise ValueError(f"batch size / concurrency {size}: use 1 or more")
    batches: list[list[int]] = []
    current: list[int] = []
    for index, label in enumerate(labels):
        if current and (len(current) == size or labels[current[0]].suite != label.suite):
            batches.append(current)
            current = []
        current.append(index)
    return batches + [current] if current else batches


def timing_of(result: GenerationResult) -> BatchTiming:
    stats = result.stats
    return BatchTiming(
        stats.wall_s,
        stats.prefill_s,
        stats.verifier_s,
        stats.draft_s,
        stats.verifier_forwards,
        stats.draft_forwards,
    )


def decode_rows(
    decode: Callable[[list[list[int]]], GenerationResult],
    prompts: Sequence[Sequence[int]],
    labels: Sequence[PromptLabel],
    spec: RunSpec,
    concurrency: int,
    log: RequestLog,
) -> tuple[list[list[int]], list[Request]]:
    """Decode every prompt ``concurrency`` at a time (with a progress bar); each request becomes one row of
    ``log``. Returns the outputs in prompt order and this run's rows."""
    from tqdm.auto import tqdm

    outputs: list[list[int]] = [[] for _ in prompts]
    rows: list[Request] = []
    with tqdm(total=len(prompts), desc=f"eval {spec.run}", unit="prompt", leave=False) as bar:
        for indices in suite_batches(labels, concurrency):
            result = decode([list(prompts[i]) for i in indices])
            batch, timing = log.next_batch(), timing_of(result)
            accepted = result.stats.accepted or [[] for _ in indices]
            for index, tokens, steps in zip(indices, result.tokens, accepted, strict=True):
                outputs[index] = tokens
                row = request_row(
                    index, labels[index], len(prompts[index]), tokens, steps, spec, concurrency, batch, timing
                )
                rows.append(log.record(row, tokens))
            bar.update(len(indices))
    log.rows += rows
    return outputs, rows


def request_row(
    index: int,
    label: PromptLabel,
    prompt_tokens: int,
    output: Sequence[int],
    accepted_per_step: Sequence[int],
    spec: RunSpec,
    concurrency: int,
    batch: int,
    timing: BatchTiming,
    drafted_per_step: Sequence[int] | None = None,
) -> Request:
    return Request(
        request=index,
        suite=label.suite,
        category=label.category,
        prompt_id=label.prompt_id,
        turn=label.turn,
        prompt_tokens=prompt_tokens,
        output_tokens=len(output),
        engine=spec.engine,
        run=spec.run,
        method=spec.method,
        k=spec.k,
        concurrency=concurrency,
        batch=batch,
        accepted_per_step=[int(a) for a in accepted_per_step],
        drafted_per_step=[int(d) for d in drafted_per_step]
        if drafted_per_step is not None
        else [spec.drafted] * len(accepted_per_step),
        timing=timing,
    )


def vllm_rows(
    theirs: dict[str, Any],
    spec: RunSpec,
    prompts: Sequence[Sequence[int]],
    labels: Sequence[PromptLabel],
    log: RequestLog,
) -> list[Request]:
    """vLLM's per-request counters of one run (``--per-request-spec-decode-metrics detailed``) as rows. One engine
    call decoded every prompt together: one batch, its wall time shared."""
    requests = theirs.get("requests") or []
    if len(requests) != len(prompts) or any(r is None or "per_step_accepted" not in r for r in requests):
        raise ValueError(
            f"vLLM run {spec.run}: expected detailed per-request spec-decode metrics for {len(prompts)} requests "
            "(per_step_accepted); the worker must run with per_request_spec_decode_metrics='detailed'"
        )
    batch, timing = log.next_batch(), BatchTiming(wall_s=float(theirs.get("wall_seconds") or 0.0))
    rows = [
        log.record(
            request_row(
                i,
                labels[i],
                len(prompts[i]),
                theirs["token_ids"][i],
                metrics["per_step_accepted"],
                spec,
                len(prompts),
                batch,
                timing,
                metrics["per_step_drafted"],
            ),
            theirs["token_ids"][i],
        )
        for i, metrics in enumerate(requests)
    ]
    log.rows += rows
    return rows


def compare_requests(ours: list[Request], theirs: list[Request]) -> dict[str, Any]:
    """Request by request, whether two engines counted the same verify steps with the same accepted drafts."""
    by_request = {row.request: row for row in ours}
    differing = [
        row.request
        for row in theirs
        if row.request not in by_request or by_request[row.request].accepted_per_step != row.accepted_per_step
    ]
    return {
        "requests_compared": len(theirs),
        "per_request_counters_equal": (len(theirs) - len(differing)) / len(theirs) if theirs else None,
        "requests_differing": differing[:20],
    }
