"""The few lines a user reads first after an evaluation: the k being served and why, the speed-up one request at a
time with the batched figure beside it, and why a tiny CPU verifier gains less than a GPU one.

Why a separate view: ``format_table`` lists every run; a user deciding whether the draft helps needs the figure at
the k that will be served (the one the k x concurrency sweep chose, :func:`speculators.eval.table.k_sweep`), at the
concurrency they serve at. ``make demo`` prints these lines last (scripts/demo.sh). Every number is read from the
results of ``speculators eval`` (themselves computed from its request table); nothing here measures.
"""

from __future__ import annotations

from typing import Any


def draft_cost_share(run: dict[str, Any]) -> float | None:
    """One draft forward's time as a fraction of one verifier forward's, from a run's own timings (our engine).

    This is what bounds the speed-up of a small verifier: every drafted token costs this share of a verifier step
    whether it is accepted or not. A 135M verifier on a CPU is barely larger than its one-layer draft; a GPU
    verifier of billions of parameters costs tens of draft forwards per forward."""
    draft_s, draft_n = run.get("draft_s"), run.get("draft_forwards")
    verifier_s, verifier_n = run.get("verifier_s"), run.get("verifier_forwards")
    if not (draft_s and draft_n and verifier_s and verifier_n):
        return None
    return (draft_s / draft_n) / (verifier_s / verifier_n)


def served_run(results: dict[str, Any]) -> dict[str, Any]:
    """The chain run an evaluation at the served k made (the demo runs one); the first chain when there are more."""
    chains = [run for run in results.get("runs") or [] if run.get("method") == "chain"]
    if not chains:
        raise ValueError("no chain run in these results: evaluate at the k to serve (speculators eval -k K)")
    return chains[0]


def choice_line(k: int, sweep: dict[str, Any] | None) -> str:
    """Where ``k`` came from: the sweep's best at one request at a time, with the other points' speed-ups."""
    if not sweep:
        return f"served k = {k} (no k sweep given)"
    best = (sweep.get("best_k") or {}).get("1")
    points = [p for p in sweep.get("points") or [] if p.get("concurrency") == 1]
    figures = ", ".join(
        f"k{p['k']} {_times(p.get('speedup'))}"
        if p.get("speedup")
        else f"k{p['k']} {p['tokens_per_s']:.1f} tok/s"
        for p in points
        if p.get("tokens_per_s")
    )
    if best is None:
        return f"served k = {k} (the sweep measured no point at one request at a time)"
    origin = "the sweep's best" if int(best) == k else f"set by hand; the sweep's best is k = {best}"
    return f"served k = {k}: {origin} at one request at a time (our engine: {figures})"


def headline(results: dict[str, Any], sweep: dict[str, Any] | None = None) -> list[str]:
    """The lines: the served k and the sweep behind it (``sweep``: ``reports.k_sweep`` of the run that chose it,
    else this evaluation's own), one request at a time (our engine and vLLM), the batched figures beside it, and
    the one sentence on the draft's cost."""
    run = served_run(results)
    k = int(run["k"])
    own_sweep = (results.get("reports") or {}).get("k_sweep") or {}
    lines = [choice_line(k, sweep or own_sweep)]
    batch = (results.get("settings") or {}).get("batch_size")
    vllm = (results.get("vllm") or {}).get(run["name"]) or {}
    one = f"  one request at a time: ours {_speed(run.get('tokens_per_s'), run.get('speedup'), 'plain')}"
    if batch != 1:
        one = f"  {batch} requests at a time: ours {_speed(run.get('tokens_per_s'), run.get('speedup'), 'plain')}"
    if vllm.get("tokens_per_s_one_at_a_time"):
        one += f"; vLLM {_speed(vllm['tokens_per_s_one_at_a_time'], vllm.get('speedup_vs_vllm_plain_one_at_a_time'), 'vLLM without the draft')}"
    lines.append(one)
    parts = [
        f"ours {p['concurrency']} at once {_speed(p.get('tokens_per_s'), p.get('speedup'), 'plain')}{where}"
        for p, where in batched_points(k, batch, own_sweep, sweep)
    ]
    if vllm.get("tokens_per_s"):
        count = (results.get("prompts") or {}).get("count")
        parts.append(
            f"vLLM all {count} prompts at once {_speed(vllm['tokens_per_s'], vllm.get('speedup_vs_vllm_plain'), 'vLLM without the draft')}"
        )
    if parts:
        lines.append("  batched beside it: " + "; ".join(parts))
    share = draft_cost_share(run)
    if share is not None:
        lines.append(
            f"  why a tiny CPU verifier gains less than a GPU one: here one draft forward costs {share:.0%} of a "
            f"verifier forward, so the {k} draft(s) of each step cost {k * share:.0%} of a verifier step before any "
            "is accepted, while a GPU verifier of billions of parameters costs tens of draft forwards per forward."
        )
    return lines


def batched_points(
    k: int, batch: int | None, own_sweep: dict[str, Any], sweep: dict[str, Any] | None
) -> list[tuple[dict[str, Any], str]]:
    """Our engine's batched points at ``k``, each with where it was measured: this evaluation's own, else (an
    evaluation run one request at a time only, as ``make demo``'s is, to save its minutes) the k sweep's point at
    the same k, marked as such since the sweep decoded its own prompts."""

    def at_k(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [p for p in points if p.get("k") == k and p.get("concurrency") not in (None, batch)]

    own = at_k(own_sweep.get("points") or [])
    if own or not sweep:
        return [(p, "") for p in own]
    return [(p, " in the k sweep") for p in at_k(sweep.get("points") or [])]


def _times(value: float | None) -> str:
    return f"{value:.2f}x" if value else "-"


def _speed(tokens_per_s: float | None, speedup: float | None, against: str) -> str:
    if not tokens_per_s:
        return "not measured"
    return f"{tokens_per_s:.1f} tok/s" + (f" ({speedup:.2f}x {against})" if speedup else "")


__all__ = ["draft_cost_share", "headline"]
