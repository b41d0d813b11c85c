"""Capture tokens/s of data_gen's two capture back ends side by side, on the embedded verifier (SmolLM2-135M).

The same real ShareGPT conversations (chat template applied, as data_gen encodes them) go through
``transformers`` (the HF verifier in this process, padded length-sorted batches) and ``vllm`` (vLLM's
``extract_hidden_states`` in its worker; ``data_gen/vllm_capture.py``), each timed end to end as data_gen calls it:
token ids in, per-sample ``aux_hidden`` / ``last_hidden`` on this process's CPU out. Runs alternate between the
back ends (the order flips every repeat), each records the CPU other processes used meanwhile
(``machine_load.LoadWindow``); vLLM's engine start is paid in an untimed warm-up and reported apart. Both use
``--threads`` threads and the same dtype (fp32 unless the CPU has native bf16, or ``--dtype``). The features of the
two back ends are compared too (worst relative error per token), so a fast wrong back end cannot pass unnoticed.

    .venv/bin/python bench/capture_backends.py [--conversations 32] [--max-length 512] [--repeats 3]
    .venv/bin/python bench/capture_backends.py --conversations 4 --max-length 128 --repeats 1   # smallest

Writes bench/results/capture_backends.json (atomic; no local paths).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.data_gen_bench import encode
from bench.machine_load import LoadWindow
from bench.record import REPO, bullet, machine, num, times
from data_gen.capture import resolve_aux_layer_ids
from data_gen.capture_backends import CaptureSettings, Features, TransformersCapture
from data_gen.vllm_capture import VllmCapture
from speculators.atomic import atomic_write_json
from speculators.local_paths import scrub
from speculators.verifier import embedded_verifier_dir, load_verifier


def pick_dtype(requested: str) -> torch.dtype:
    """fp32 unless the CPU multiplies bf16 natively (elsewhere bf16 matmuls run at ~1 GFLOP/s: docs/environment.md)."""
    if requested != "auto":
        return getattr(torch, requested)
    return torch.bfloat16 if machine()["native_bf16"] else torch.float32


def worst_relative_error(ours: list[Features], theirs: list[Features]) -> float:
    worst = 0.0
    for (aux_a, last_a), (aux_b, last_b) in zip(ours, theirs, strict=True):
        for a, b in ((aux_a, aux_b), (last_a, last_b)):
            error = (a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1).clamp_min(1e-6)
            worst = max(worst, float(error.max()))
    return worst


def timed_capture(
    backend: Any, sequences: list[list[int]], tokens: int
) -> tuple[dict[str, Any], list[Features]]:
    with LoadWindow() as window:
        started = time.perf_counter()
        features = backend.capture(sequences)
        seconds = time.perf_counter() - started
    return {
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        **window.report(),
    }, features


def run(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument(
        "--batch-size", type=int, default=8, help="transformers: sequences per padded forward"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--output", default=str(REPO / "bench" / "results" / "capture_backends.json"))
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    dtype = pick_dtype(args.dtype)
    verifier_dir = embedded_verifier_dir()
    model, tokenizer = load_verifier(str(verifier_dir), dtype, torch.device("cpu"))
    num_layers = int(model.config.num_hidden_layers)
    aux_ids = resolve_aux_layer_ids(None, num_layers)
    sequences = [list(s.input_ids) for s in encode(tokenizer, args.conversations, args.max_length)]
    tokens = sum(len(s) for s in sequences)
    dtype_name = str(dtype).replace("torch.", "")

    backends = {
        "transformers": TransformersCapture(model, aux_ids, args.batch_size, tokenizer.pad_token_id or 0),
        "vllm": VllmCapture(
            str(verifier_dir),
            aux_ids,
            num_layers,
            dtype_name,
            args.max_length,
            CaptureSettings(threads=args.threads),
        ),
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in backends}
    features: dict[str, list[Features]] = {}
    try:
        started = time.perf_counter()
        backends["vllm"].capture(sequences[:1])  # untimed: worker import and engine start
        vllm_start_s = time.perf_counter() - started
        backends["transformers"].capture(sequences[:1])
        for repeat in range(args.repeats):
            order = list(backends) if repeat % 2 == 0 else list(reversed(backends))
            for name in order:
                record, features[name] = timed_capture(backends[name], sequences, tokens)
                runs[name].append({"repeat": repeat, **record})
                print(f"{name:>12}: {record['tokens_per_s']:8.1f} tokens/s  ({record})", flush=True)
    finally:
        for backend in backends.values():
            backend.close()

    rates = {name: statistics.median(r["tokens_per_s"] for r in records) for name, records in runs.items()}
    result = {
        "benchmark": "capture_backends",
        "command": scrub(" ".join([sys.executable, *sys.argv]), REPO),  # repo-relative, no local path
        "verifier": "SmolLM2-135M-Instruct (embedded)",
        "dtype": dtype_name,
        "threads": args.threads,
        "conversations": len(sequences),
        "tokens": tokens,
        "max_length": args.max_length,
        "transformers_batch_size": args.batch_size,
        "aux_layer_ids": aux_ids,
        "repeats": args.repeats,
        "tokens_per_s_median": rates,
        "vllm_over_transformers": rates["vllm"] / rates["transformers"],
        "vllm_engine_start_s": round(vllm_start_s, 2),
        "worst_relative_error_vllm_vs_transformers": worst_relative_error(
            features["vllm"], features["transformers"]
        ),
        "contended_runs": sum(bool(r.get("contended")) for records in runs.values() for r in records),
        "runs": runs,
        "machine": machine(),
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.output, result)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))


# ---- its section of bench/results/SUMMARY.md ------------------------------------------------------------------
RESULTS = ("capture_backends",)  # the result files this bench writes (bench/results/<stem>.json)


def render(result: dict[str, Any]) -> list[str]:
    """capture_backends.json's section of SUMMARY.md."""
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


if __name__ == "__main__":
    run()
