"""What fp8 feature storage does to the draft: the same recipe trained on bf16 and on fp8 features, compared by
held-out simulated acceptance length (the trainer's own evaluation). Goal: <= 1 % acceptance lost at half the bytes.

1. data_gen once (recipe ``eagle3_smollm2``, the demo: 200 ShareGPT conversations, bf16 features).
2. An fp8 copy of the TRAIN split: every shard re-quantised with data_gen's own fp8 path (float8_e4m3fn, one
   float32 scale per row and aux layer), from the bf16 values (double rounding bf16 -> fp8 differs from fp32 -> fp8
   only at rounding ties). The held-out split is shared: both drafts are validated on the same bf16 features,
   closest to the full-precision features vLLM hands the draft at inference.
3. Training, same recipe and seed, one thread each, side by side: ``bf16``, ``fp8``, and ``bf16`` with another seed
   (``seed=1``) as the run-to-run yardstick a difference has to beat.

    .venv/bin/python bench/fp8_bench.py [--root outputs/bench_fp8] [--max-conversations 200] [--epochs 1]

Writes bench/results/fp8.json. Stages whose output exists are reused (rerun after an interruption).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.record import REPO, as_measured, flat_figures

PY = sys.executable
RECIPE = "eagle3_smollm2"


def run_stage(command: list[str], log: Path, one_thread: bool = True) -> float:
    """Run a stage subprocess (output to ``log``); its wall seconds; raise with the log tail on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled")
    if one_thread:
        env["OMP_NUM_THREADS"] = "1"
    started = time.monotonic()
    with open(log, "w") as handle:
        code = subprocess.call(command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT)
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise RuntimeError(f"{' '.join(command)} failed ({code}); see {log}:\n{tail}")
    return time.monotonic() - started


def fp8_copy(bf16_dir: Path, fp8_dir: Path) -> None:
    """``fp8_dir``: the train split re-quantised to fp8 through data_gen's store; held-out and token counts shared."""
    from data_gen.store import (
        MANIFEST_NAME,
        TOKEN_COUNTS_NAME,
        FeatureDataset,
        Sample,
        finalize_split,
        read_manifest,
        write_shard,
    )

    if (fp8_dir / "train" / MANIFEST_NAME).is_file():
        return
    manifest = read_manifest(bf16_dir / "train")
    dataset = FeatureDataset(bf16_dir / "train")
    num_aux = len(manifest["aux_layer_ids"])
    position = 0
    for shard in manifest["shards"]:
        samples = []
        for _ in shard["sample_ids"]:
            item = dataset[position]
            position += 1
            samples.append(
                Sample(
                    item["sample_id"],
                    item["input_ids"],
                    item["loss_mask"],
                    item["aux_hidden"],
                    item["last_hidden"],
                )
            )
        write_shard(fp8_dir / "train", shard["index"], samples, num_aux, "fp8")
    header = {k: v for k, v in manifest.items() if k not in ("shards", "num_shards", "bytes", "split")}
    header["storage_dtype"] = "fp8"
    finalize_split(fp8_dir / "train", manifest["num_shards"], header)
    for name in ("heldout", TOKEN_COUNTS_NAME):
        link = fp8_dir / name
        if not link.exists():
            link.symlink_to((bf16_dir / name).resolve())


def train_command(data: Path, run_dir: Path, epochs: int, seed: int) -> list[str]:
    return [
        PY,
        "train/run.py",
        f"recipe={RECIPE}",
        *as_measured(RECIPE),
        f"train.data_dir={data}",
        f"run_dir={run_dir}",
        f"train.epochs={epochs}",
        f"seed={seed}",
        "train.cpu_threads=1",
        "logging=disabled",
        "logging.progress_bar=false",
    ]


def run_summary(run_dir: Path) -> dict[str, Any]:
    """The best held-out evaluation of a run (the checkpoint selection's own numbers)."""
    best = json.loads((run_dir / "checkpoints" / "best.json").read_text())
    metrics = best["metrics"]
    return {
        "best_step": best["step"],
        "acceptance_length": best["acceptance_length"],
        "acceptance_length_max": metrics.get("eval/acceptance_length_max"),
        "acc": [metrics.get(f"eval/acc_{j}") for j in range(3)],
        "eval_loss": metrics.get("eval/loss"),
        "eval_positions": metrics.get("eval/positions"),
    }


def run(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="outputs/bench_fp8")
    parser.add_argument("--max-conversations", type=int, default=200)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args(argv)
    root = (REPO / args.root).resolve()
    bf16_dir, fp8_dir = root / "data_bf16", root / "data_fp8"
    seconds: dict[str, float] = {}
    if not (bf16_dir / "train" / "manifest.json").is_file():
        command = [
            PY,
            "data_gen/run.py",
            f"recipe={RECIPE}",
            f"data_gen.output_dir={bf16_dir}",
            f"data.max_conversations={args.max_conversations}",
            "data_gen.storage_dtype=bfloat16",
            f"run_dir={root / 'data_gen_run'}",
        ]
        seconds["data_gen"] = run_stage(command, root / "logs" / "data_gen.log", one_thread=False)
    started = time.monotonic()
    fp8_copy(bf16_dir, fp8_dir)
    seconds["fp8_copy"] = time.monotonic() - started
    runs = {"bf16": (bf16_dir, 0), "fp8": (fp8_dir, 0), "bf16_seed1": (bf16_dir, 1)}
    pending = {n: v for n, v in runs.items() if not (root / n / "checkpoints" / "best.json").is_file()}
    with ThreadPoolExecutor(len(pending) or 1) as pool:
        futures = {
            name: pool.submit(
                run_stage,
                train_command(data, root / name, args.epochs, seed),
                root / "logs" / f"train_{name}.log",
            )
            for name, (data, seed) in pending.items()
        }
        for name, future in futures.items():
            seconds[f"train_{name}"] = future.result()
    results = {name: run_summary(root / name) for name in runs}
    bf16_al, fp8_al = results["bf16"]["acceptance_length"], results["fp8"]["acceptance_length"]
    seed_al = results["bf16_seed1"]["acceptance_length"]
    train_bytes = {
        name: json.loads((d / "train" / "manifest.json").read_text())["bytes"]
        for name, d in (("bf16", bf16_dir), ("fp8", fp8_dir))
    }
    tokens = json.loads((bf16_dir / "train" / "manifest.json").read_text())["num_tokens"]
    out = {
        "benchmark": "held-out simulated acceptance length of the same recipe trained on bf16 vs fp8 features",
        "recipe": RECIPE,
        "verifier": "embedded SmolLM2-135M-Instruct (dequantized from its Q4_1 GGUF, not the published weights)",
        "machine": f"{platform.platform()}, {os.cpu_count()} CPUs, shared with other jobs (throughput not measured)",
        "max_conversations": args.max_conversations,
        "epochs": args.epochs,
        "train_tokens": tokens,
        "train_bytes_per_token": {k: v / tokens for k, v in train_bytes.items()},
        "bytes_ratio_fp8_vs_bf16": train_bytes["fp8"] / train_bytes["bf16"],
        "runs": results,
        "acceptance_lost_fp8_vs_bf16_pct": 100.0 * (bf16_al - fp8_al) / bf16_al,
        "seed_difference_bf16_pct": 100.0 * abs(bf16_al - seed_al) / bf16_al,
        "goal": "<= 1 % acceptance lost at half the bytes",
        "seconds": seconds,
    }
    out["goal_met"] = out["acceptance_lost_fp8_vs_bf16_pct"] <= 1.0 and out["bytes_ratio_fp8_vs_bf16"] <= 0.55
    from speculators.atomic import atomic_write_json

    atomic_write_json(REPO / "bench" / "results" / "fp8.json", out)
    print(json.dumps(out, indent=1))
    shutil.rmtree(root / "data_gen_run" / "hydra", ignore_errors=True)
    return 0


# ---- its section of bench/results/SUMMARY.md ------------------------------------------------------------------
RESULTS = ("fp8",)  # the result files this bench writes (bench/results/<stem>.json)


def render(result: dict[str, Any]) -> list[str]:
    """fp8.json's section of SUMMARY.md: its summary's figures, flat."""
    return flat_figures(result)


if __name__ == "__main__":
    raise SystemExit(run())
