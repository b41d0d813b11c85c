"""The learning curve's bookkeeping: tokens and CPU accumulate from the trainer's records, vLLM points land on
their steps, and the log-linear extrapolation reads back a known line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.learning_curve import curve_points, log_fit, tokens_for, write_curve


def _records(
    al_at_step: dict[int, float], tokens_per_step: int = 1000, cpu_per_step: float = 2.0
) -> list[dict]:
    records = []
    for step in range(1, max(al_at_step) + 1):
        records.append(
            {"kind": "train", "step": step, "tokens": tokens_per_step, "process_cpu_s": cpu_per_step * step}
        )
        if step in al_at_step:
            records.append({"kind": "eval", "step": step, "eval/acceptance_length": al_at_step[step]})
    return records


def test_points_accumulate_tokens_and_cpu_and_place_vllm_values() -> None:
    points = curve_points(_records({2: 1.1, 4: 1.2}), {4: 1.25}, capture_cpu_s=3600.0)
    assert [p["step"] for p in points] == [2, 4]
    assert [p["training_tokens"] for p in points] == [2000, 4000]
    assert [p["train_cpu_s"] for p in points] == [4.0, 8.0]
    assert points[1]["cpu_hours"] == pytest.approx((3600 + 8) / 3600, abs=1e-4)
    assert points[0]["vllm_al_k3"] is None and points[1]["vllm_al_k3"] == 1.25


def test_log_fit_recovers_a_known_line_and_extrapolates() -> None:
    # AL = 0.5 + 0.25 * log10(tokens): 1000 tokens per step, so AL at step s is 0.5 + 0.25 * log10(1000 s)
    al = {s: 0.5 + 0.25 * math.log10(1000 * s) for s in (1, 10, 100)}
    points = curve_points(_records(al), {}, 0.0)
    fit = log_fit(points, "simulated_al")
    assert fit["slope_per_decade"] == pytest.approx(0.25)
    assert fit["intercept"] == pytest.approx(0.5)
    assert tokens_for(fit, 2.0) == pytest.approx(1e6, rel=1e-6)
    assert log_fit(points, "vllm_al_k3") is None  # no vLLM points: no fit from them
    assert tokens_for({"intercept": 1.0, "slope_per_decade": -0.1, "points": 3}, 2.0) is None


def test_write_curve_writes_json_and_plot(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    lines = _records({s: 1.0 + 0.01 * s for s in (5, 10, 15)})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    out = tmp_path / "curve.json"
    result = write_curve(run, {15: 1.2}, 100.0, out, 2.0, {"title": "t"})
    assert json.loads(out.read_text())["points"] == result["points"]
    assert out.with_suffix(".svg").read_text().lstrip().startswith("<?xml")
    assert result["log_fit"]["series"] == "simulated_al"  # fewer than three vLLM points


def test_evaluations_between_sparse_train_logs_are_interpolated() -> None:
    # train records every 10 steps (logging.log_every), evaluations every 4: tokens and CPU in between are linear
    records = [
        {"kind": "train", "step": 10, "tokens": 1000, "process_cpu_s": 20.0},
        {"kind": "eval", "step": 4, "eval/acceptance_length": 1.1},
        {"kind": "train", "step": 20, "tokens": 1000, "process_cpu_s": 40.0},
        {"kind": "eval", "step": 15, "eval/acceptance_length": 1.2},
    ]
    points = curve_points(records, {}, 0.0)
    assert [p["training_tokens"] for p in points] == [400, 1500]
    assert [p["train_cpu_s"] for p in points] == [8.0, 30.0]
