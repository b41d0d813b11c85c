"""`make bench`: run every benchmark in turn and write bench/results/SUMMARY.md from their JSON results.

Each benchmark is a plain script that writes ``bench/results/<name>.json``; this runner only sequences them (one at
a time: they measure throughput on a shared CPU) and condenses the headline figures into a markdown table.
A benchmark that fails is reported in the summary; the others still run.

    python bench/run.py                  # all benchmarks (the acceptance one trains drafts: about an hour on 2 cores)
    python bench/run.py --only engine    # a subset, by name
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
LOG_HEADING = "## Measurement log"
# name -> script; the order is cheapest first, so a quick look at the suite needs no trained draft.
BENCHMARKS = {
    "data_gen": "bench/data_gen_bench.py",
    "train": "bench/train_bench.py",
    "engine": "bench/engine_bench.py",
    "acceptance": "bench/acceptance_bench.py",
}


def headline(name: str, result: dict) -> list[str]:
    """The figures a reader looks for first, as markdown bullet lines (missing keys are skipped, not invented)."""
    lines: list[str] = []

    def add(label: str, value: object) -> None:
        if value is not None:
            lines.append(f"- {label}: {value}")

    if name == "data_gen":
        tps = result.get("tokens_per_s", {})
        add("capture tokens/s", _round(tps.get("capture")))
        add("bare decoder tokens/s", _round(tps.get("bare_decoder")))
        add("capture overhead vs bare forward", _pct(result.get("capture_overhead_vs_bare_decoder")))
        for dtype, info in result.get("storage", {}).items():
            add(
                f"bytes/token {dtype}",
                f"{_round(info.get('bytes_per_token'))} ({_round(info.get('vs_naive'), 3)}x naive)",
            )
    elif name == "train":
        for run in result.get("throughput", {}).get("runs", []):
            add(f"training tokens/s ({run.get('threads')} thread(s))", run.get("tokens_per_s"))
        memory = result.get("ttt_attention_memory", {})
        add(
            "TTT attention peak MiB by length",
            {r["length"]: r["peak_mib"] for r in memory.get("chunked", [])},
        )
        add("grows linearly", memory.get("chunked_grows_linearly"))
    elif name == "engine":
        for run in result.get("runs", []):
            add(
                f"k={run.get('k')}: speculative vs plain tokens/s",
                f"{_round(run.get('speculative_tokens_per_s'))} vs {_round(run.get('plain_tokens_per_s'))} "
                f"(speedup {_round(run.get('speedup'), 2)}x at AL {_round(run.get('acceptance_length_global'), 2)}; "
                f"{_round(100 * run.get('fraction_of_bound', 0))}% of the cost bound)",
            )
    elif name == "acceptance" and isinstance(result.get("summary"), dict):
        lines += acceptance_table(result)
    else:
        summary = result.get("summary")
        if isinstance(summary, dict):
            for key, value in summary.items():
                add(key, value)
    return lines


def acceptance_table(result: dict) -> list[str]:
    """vLLM-measured greedy acceptance length and speed by drafter and k, the curve, T = 0.7 and the goals."""
    summary = result["summary"]
    table = summary.get("greedy_acceptance_length", {})
    per_step = summary.get("tokens_per_verify_step", {})
    speed = summary.get("speed", {})
    plain = summary.get("plain_tokens_per_s") or {}
    ks = sorted({k for row in table.values() for k in row}, key=lambda k: int(k[1:]))
    lines = [
        f"- mode {result.get('mode')}; {result.get('prompts', {}).get('count')} held-out prompts, "
        f"{result.get('prompts', {}).get('max_new_tokens')} new tokens; total {result.get('total_wall_s')} s",
        "",
        "| drafter (vLLM, greedy) | "
        + " | ".join(f"AL k={k[1:]}" for k in ks)
        + " | tokens/verify step k=3 |",
        "|---" * (len(ks) + 2) + "|",
    ]
    for drafter, row in table.items():
        cells = [str(_round(row.get(k), 3)) for k in ks]
        lines.append(
            f"| {drafter} | " + " | ".join(cells) + f" | {_round(per_step.get(drafter, {}).get('k3'), 3)} |"
        )
    for mode, label in (("batch1", "one request at a time"), ("batched", "all prompts batched")):
        rows = speed.get(mode, {})
        if not rows:
            continue
        lines += [
            "",
            f"| tokens/s, {label} (plain {_round(plain.get(mode))}) | "
            + " | ".join(f"k={k[1:]}" for k in ks)
            + " |",
            "|---" * (len(ks) + 1) + "|",
        ]
        for drafter, row in rows.items():
            cells = [
                f"{_round((row.get(k) or {}).get('tokens_per_s'))} ({_times((row.get(k) or {}).get('speedup_vs_plain'))})"
                for k in ks
            ]
            lines.append(f"| {drafter} | " + " | ".join(cells) + " |")
    lines.append("")
    if summary.get("contended_runs"):
        lines.append(f"- contended runs (other processes > 10 % of a core): {summary['contended_runs']}")
    sampled = summary.get("engine_T0.7_acceptance_length_k3") or {}
    if sampled:
        lines.append(
            "- AL at T=0.7, k=3 (our engine): " + ", ".join(f"{n} {_round(v, 3)}" for n, v in sampled.items())
        )
    goals = summary.get("goals", {})
    lines.append(
        f"- goals: EAGLE-3 AL at k=3 >= {goals.get('eagle3_al_k3_goal')}: "
        f"{'met' if goals.get('eagle3_goal_met') else 'NOT met'} ({_round(goals.get('eagle3_al_k3_greedy'), 3)}; "
        f"before {goals.get('eagle3_al_k3_before')}); above n-gram's tokens per verify step "
        f"({_round(goals.get('ngram_tokens_per_verify_step_k3'), 3)}): "
        f"{'yes' if goals.get('eagle3_beats_ngram_per_step') else 'no'}; HASS {goals.get('hass_goal')}: "
        f"{'met' if goals.get('hass_goal_met') else 'NOT met'} (gain {_pct(goals.get('hass_gain_over_eagle3'))}); "
        f"ours / peer accepted per draft {_round(goals.get('ours_over_peer_accepted_per_draft_k3'), 2)} "
        f"(goal {goals.get('ours_over_peer_goal')})"
    )
    curve = summary.get("curve")
    if curve:
        lines.append(
            f"- learning curve: {curve.get('points')} points in `{curve.get('file')}` (plot: .svg beside it)"
        )
    return lines


def _round(value, digits: int = 1):
    return None if value is None else round(float(value), digits)


def _times(value):
    return None if value is None else f"{float(value):.2f}x"


def _pct(value):
    return None if value is None else f"{100 * float(value):+.1f}%"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), help="run only these benchmarks")
    parser.add_argument(
        "--summary-only", action="store_true", help="rewrite SUMMARY.md from existing results"
    )
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    if not args.summary_only:
        print(hardware_line(), flush=True)
    status: dict[str, str] = {}
    for name, script in BENCHMARKS.items():
        if args.only and name not in args.only:
            continue
        if args.summary_only:
            break
        print(f"\n==> bench {name}: {script}", flush=True)
        start = time.monotonic()
        code = subprocess.call([sys.executable, str(REPO / script)], cwd=REPO)
        status[name] = f"exit {code} after {time.monotonic() - start:.0f} s"
    write_summary(status)
    return 0 if all(s.startswith("exit 0") for s in status.values()) else 1


def hardware_line() -> str:
    """What the figures are measured on, printed first: figures from different processors are not comparable."""
    from speculators.precision import machine_record

    record = machine_record()
    cpu, flags = record["cpu"], record["cpu"]["flags"]
    auto = ", ".join(f"{device} {d['dtype']} ({d['reason']})" for device, d in record["auto_dtype"].items())
    return (
        f"hardware: {cpu['model']}, {__import__('os').cpu_count()} CPUs, torch {record['torch']} capability "
        f"{cpu['capability']}, flags {' '.join(f for f, on in flags.items() if on) or 'none'}; auto dtype: {auto}"
        + (f"; GPU {record['cuda_device']}" if "cuda_device" in record else "")
    )


def verifier_note() -> str:
    """Whose weights every benchmark's verifier is (all of them run on the embedded SmolLM2)."""
    from speculators.verifier import EMBEDDED_WEIGHTS_NOTE

    return EMBEDDED_WEIGHTS_NOTE


def write_summary(status: dict[str, str]) -> None:
    lines = [
        "# Benchmark summary",
        "",
        f"Machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
        f"{__import__('os').cpu_count()} CPUs. Reproduce: `make bench` (or `python bench/run.py --only NAME`).",
        "",
        f"Verifier of every figure below: the embedded default, {verifier_note()}.",
        "",
    ]
    for name in BENCHMARKS:
        path = RESULTS / f"{name}.json"
        lines.append(f"## {name}")
        lines.append(
            "- verifier: embedded SmolLM2-135M-Instruct, dequantized from its Q4_1 GGUF (not the published weights)"
        )
        if name in status:
            lines.append(f"_this run: {status[name]}_")
        if path.exists():
            lines += headline(name, json.loads(path.read_text())) or ["- (no headline figures; see the JSON)"]
            lines.append(f"- full results: `bench/results/{name}.json`")
        else:
            lines.append("- not measured yet")
        lines.append("")
    (RESULTS / "SUMMARY.md").write_text("\n".join(lines) + _kept_log())
    print(f"wrote {RESULTS / 'SUMMARY.md'}")


def _kept_log() -> str:
    """The hand-written measurement log at the end of SUMMARY.md (from ``LOG_HEADING`` on) survives a rewrite."""
    path = RESULTS / "SUMMARY.md"
    text = path.read_text() if path.exists() else ""
    at = text.find(LOG_HEADING)
    return "\n" + text[at:] if at >= 0 else ""


if __name__ == "__main__":
    sys.exit(main())
