"""Held-out acceptance against training tokens and CPU-hours, from the checkpoints of one long run (issue 14).

Two series share the x axis:
- the trainer's own held-out evaluation at every ``eval_every`` steps (``metrics.jsonl``: the simulated acceptance
  length at the recipe's k: cheap, so it is dense);
- vLLM's greedy acceptance length at k = 3 of the exported checkpoints (``checkpoints/step-<N>``): what serving
  sees, on the bench's held-out prompts.
CPU-hours at a step = the data generation's CPU (all features are captured before training starts) + the training
process's CPU at that step (``process_cpu_s`` of the nearest train record). A least-squares line of AL against
log10(training tokens) through the vLLM points (the simulated ones where vLLM has fewer than three) gives the
tokens a goal would need *if the trend held*; it is an extrapolation and is labelled as one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from bench.record import bullet, num
from speculators.atomic import atomic_write_json, fsync_replace, temp_sibling


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def training_totals(records: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's training records (``kind`` train of its metrics) summed up: its last optimizer step, the training
    tokens, its process CPU at the last step and the CPU per step between the first and the last step (start-up
    left out; None with fewer than two records)."""
    trains = [r for r in records if r.get("kind") == "train"]
    if not trains:
        return {"steps": 0, "tokens": 0.0, "cpu_s_at_last_step": 0.0, "cpu_s_per_step": None}
    first, last = trains[0], trains[-1]
    cpu_first, cpu_last = float(first.get("process_cpu_s") or 0.0), float(last.get("process_cpu_s") or 0.0)
    span = int(last["step"]) - int(first["step"])
    return {
        "steps": int(last["step"]),
        "tokens": sum(float(r.get("tokens", 0.0)) for r in trains),
        "cpu_s_at_last_step": cpu_last,
        "cpu_s_per_step": (cpu_last - cpu_first) / max(span, 1) if len(trains) > 1 else None,
    }


def _interpolate(knots: list[tuple[int, float]], step: int) -> float:
    """Piecewise-linear value at ``step`` through ``knots`` (step, value), from (0, 0); past the last, the last."""
    previous = (0, 0.0)
    for knot in knots:
        if knot[0] >= step:
            span = knot[0] - previous[0]
            return previous[1] + (knot[1] - previous[1]) * ((step - previous[0]) / span if span else 1.0)
        previous = knot
    return previous[1]


def curve_points(
    records: list[dict[str, Any]], vllm_al: dict[int, float | None], capture_cpu_s: float
) -> list:
    """One point per evaluated step: tokens seen, CPU-hours, simulated AL and (where measured) vLLM AL.

    Train records come every ``logging.log_every`` steps with the tokens since the last one and the process CPU so
    far; an evaluation between two of them gets both by linear interpolation."""
    tokens_at, cpu_at, total = [], [], 0.0
    for record in records:
        if record.get("kind") == "train":
            total += float(record.get("tokens", 0.0))
            tokens_at.append((int(record["step"]), total))
            if record.get("process_cpu_s") is not None:
                cpu_at.append((int(record["step"]), float(record["process_cpu_s"])))
    points = []
    for record in records:
        if record.get("kind") != "eval":
            continue
        step = int(record["step"])
        cpu = _interpolate(cpu_at, step)
        points.append(
            {
                "step": step,
                "training_tokens": int(_interpolate(tokens_at, step)),
                "train_cpu_s": round(cpu, 1),
                "cpu_hours": round((capture_cpu_s + cpu) / 3600, 4),
                "simulated_al": record.get("eval/acceptance_length"),
                "vllm_al_k3": vllm_al.get(step),
            }
        )
    return points


def log_fit(points: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    """AL = a + b * log10(training tokens), least squares over the points that have ``key``."""
    pairs = [
        (math.log10(p["training_tokens"]), p[key]) for p in points if p.get(key) and p["training_tokens"] > 0
    ]
    if len(pairs) < 3:
        return None
    n = len(pairs)
    mean_x = sum(x for x, _ in pairs) / n
    mean_y = sum(y for _, y in pairs) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in pairs)
    if sxx == 0:
        return None
    slope = sum((x - mean_x) * (y - mean_y) for x, y in pairs) / sxx
    return {"series": key, "intercept": mean_y - slope * mean_x, "slope_per_decade": slope, "points": n}


def tokens_for(fit: dict[str, float] | None, target_al: float) -> float | None:
    """Training tokens at which the fitted line reaches ``target_al`` (None if it never rises)."""
    if not fit or fit["slope_per_decade"] <= 0:
        return None
    return 10 ** ((target_al - fit["intercept"]) / fit["slope_per_decade"])


def plot(points: list[dict[str, Any]], path: Path, title: str) -> None:
    """AL against training tokens (log axis), both series; written to a temporary name and renamed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.2))
    for key, label, style in (
        ("simulated_al", "trainer's simulated held-out AL", "o-"),
        ("vllm_al_k3", "vLLM greedy AL, k=3, held-out prompts", "s-"),
    ):
        xs = [p["training_tokens"] for p in points if p.get(key)]
        ys = [p[key] for p in points if p.get(key)]
        if xs:
            axis.plot(xs, ys, style, label=label)
    axis.set_xscale("log")
    axis.set_xlabel("training tokens seen (epochs x data)")
    axis.set_ylabel("acceptance length")
    axis.set_title(title, fontsize=9)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
    tmp = temp_sibling(path)
    try:
        figure.savefig(tmp, format=path.suffix.lstrip("."), bbox_inches="tight")
        fsync_replace(tmp, path)
    finally:
        plt.close(figure)
        tmp.unlink(missing_ok=True)


def write_curve(
    run_dir: Path,
    vllm_al: dict[int, float | None],
    capture_cpu_s: float,
    out_json: Path,
    goal_al: float,
    meta: dict[str, Any],
) -> dict[str, Any]:
    """Build the curve of ``run_dir``, write ``out_json`` and the plot beside it (same stem, .svg)."""
    points = curve_points(read_metrics(run_dir), vllm_al, capture_cpu_s)
    fit = log_fit(points, "vllm_al_k3") or log_fit(points, "simulated_al")
    needed = tokens_for(fit, goal_al)
    result = {
        **meta,
        "run_dir": str(run_dir),
        "capture_cpu_s": round(capture_cpu_s, 1),
        "points": points,
        "log_fit": fit,
        "extrapolation": {
            "goal_al": goal_al,
            "training_tokens_if_trend_held": round(needed) if needed else None,
            "note": "a straight line in log10(tokens) through this run's points; far outside them it is a guess",
        },
    }
    atomic_write_json(out_json, result)
    plot(points, out_json.with_suffix(".svg"), f"{meta.get('title', run_dir.name)}")
    return result


# ---- its lines in bench/results/SUMMARY.md --------------------------------------------------------------------
def render(result: dict[str, Any]) -> list[str]:
    """A learning curve's lines in its bench's section of SUMMARY.md (``<name>_curve.json`` beside ``<name>.json``):
    the fit, and where the trend would reach the goal."""
    fit, extrapolation = result.get("log_fit") or {}, result.get("extrapolation") or {}
    lines = [
        bullet(
            "log-linear fit",
            f"AL {num(fit.get('intercept'), 3)} + {num(fit.get('slope_per_decade'), 3)} per decade of training "
            f"tokens ({fit.get('points')} points, series {fit.get('series')})",
        )
    ]
    if extrapolation.get("training_tokens_if_trend_held"):
        lines.append(
            bullet(
                f"AL {extrapolation.get('goal_al')} if the trend held (an extrapolation)",
                f"{extrapolation['training_tokens_if_trend_held']:.3g} training tokens",
            )
        )
    return lines
