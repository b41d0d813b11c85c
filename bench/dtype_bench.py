"""fp32 vs bf16 compute on this processor (issue 21): what native bf16 buys, measured side by side in one run.

1. Capture tokens/s: the embedded SmolLM2-135M verifier loaded twice (fp32 and bf16), data_gen's FeatureCapture
   on the same length-sorted batches of real ShareGPT conversations (bench/data_gen_bench.py's ``encode`` and
   ``batches``), fp32 and bf16 alternating batch by batch, repeated.
2. EAGLE-3 draft training tokens/s: the real trainer (recipe ``eagle3_smollm2``) on SmolLM2-shaped features
   (bench/train_bench.py's ``write_random_features`` and ``train_throughput``), runs alternating fp32, bf16, fp32,
   bf16, ... (bf16 = autocast over fp32 master weights).
   Every timed window records the CPU other processes used meanwhile (bench/machine_load.py).
3. Held-out simulated acceptance length (the trainer's own evaluation): data_gen in fp32 and in bf16
   (``verifier.dtype``), then the draft trained on each in its own dtype (``train.dtype``), seeds 0 and 1, the same
   steps (bench/fp8_bench.py's stage runner and training command). Each draft is validated on the held-out
   features of its own capture: the pipeline end to end in one dtype. The bf16-fp32 difference is set against the
   seed spread.

    .venv/bin/python bench/dtype_bench.py --quick   # < 4 min on 2 cores: proves the stages; figures indicative
    .venv/bin/python bench/dtype_bench.py           # < 20 min

Stages of part 3 whose output exists under --root are reused (rerun after an interruption). Writes
bench/results/dtype.json (--quick: dtype_quick.json) with the machine record (CPU model, torch's
capability, the bf16/AVX flags, what ``auto`` chooses there and why) and the bf16/fp32 speed-up ratios. On a CPU
without native bf16 the ratios come out far below 1: the measured reason ``auto`` keeps fp32 there.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from bench import data_gen_bench, fp8_bench, train_bench
from bench.machine_load import LoadWindow
from bench.record import REPO, bullet, machine, num, times
from speculators.atomic import atomic_write_json
from speculators.local_paths import scrub

DTYPES = ("float32", "bfloat16")  # measured in this order, alternating
TRAIN_NAMES = {"float32": "fp32", "bfloat16": "bf16"}  # train.dtype's spelling
SEEDS = (0, 1)
SETTINGS = {
    "quick": {
        "capture_conversations": 4,
        "capture_max_length": 256,
        "capture_repeats": 1,
        "train_steps": 3,  # the first warms up
        "train_rounds": 1,
        "al_conversations": 16,
        "al_heldout_fraction": 0.25,
        "al_max_length": 256,
        "al_max_steps": 6,
        "al_eval_samples": 8,
    },
    "full": {
        "capture_conversations": 24,
        "capture_max_length": 512,
        "capture_repeats": 2,
        "train_steps": 5,
        "train_rounds": 2,
        "al_conversations": 128,
        "al_heldout_fraction": 0.1,
        "al_max_length": 512,
        "al_max_steps": 120,
        "al_eval_samples": 32,
    },
}
CAPTURE_BATCH = 4


# ---- 1. capture ---------------------------------------------------------------------------------------------
def capture_throughput(cfg: dict[str, Any]) -> dict[str, Any]:
    """Capture tokens/s of the verifier in each dtype over the same batches, alternating batch by batch."""
    from data_gen.capture import FeatureCapture
    from speculators.verifier import load_verifier

    captures, tokenizer = {}, None
    for dtype in DTYPES:
        model, tokenizer = load_verifier("smollm2", dtype, "cpu")
        captures[dtype] = FeatureCapture(model, out_dtype=None)
    encoded = data_gen_bench.encode(tokenizer, cfg["capture_conversations"], cfg["capture_max_length"])
    work = data_gen_bench.batches(encoded, CAPTURE_BATCH, tokenizer.pad_token_id or 0)
    real_tokens = sum(len(s.input_ids) for s in encoded)

    def run(dtype: str, ids: torch.Tensor, mask: torch.Tensor) -> float:
        started = time.perf_counter()
        captures[dtype].capture(ids, mask)
        return time.perf_counter() - started

    for dtype in DTYPES:  # warm-up: first-call allocations and kernel selection
        run(dtype, *work[0])
    seconds = dict.fromkeys(DTYPES, 0.0)
    with LoadWindow() as window:
        for _ in range(cfg["capture_repeats"]):
            for ids, mask in work:
                for dtype in DTYPES:
                    seconds[dtype] += run(dtype, ids, mask)
    rates = {d: cfg["capture_repeats"] * real_tokens / s for d, s in seconds.items()}
    captures.clear()  # free both verifiers before the training stage
    gc.collect()
    return {
        "samples": len(encoded),
        "real_tokens": real_tokens,
        "batch_size": CAPTURE_BATCH,
        "max_length": cfg["capture_max_length"],
        "repeats": cfg["capture_repeats"],
        "threads": torch.get_num_threads(),
        "tokens_per_s": {d: round(r, 1) for d, r in rates.items()},
        "speedup_bf16_vs_fp32": round(rates["bfloat16"] / rates["float32"], 3),
        "load": window.report(),
    }


# ---- 2. training --------------------------------------------------------------------------------------------
def training_throughput(cfg: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """Draft-training tokens/s in each dtype, whole runs alternating fp32, bf16, fp32, bf16, ..."""
    data_dir = tmp / "train_data"
    train_bench.write_random_features(data_dir, samples=4 * (cfg["train_steps"] + 1), length=512)
    runs: dict[str, list[dict[str, Any]]] = {d: [] for d in DTYPES}
    for round_index in range(cfg["train_rounds"]):
        for dtype in DTYPES:
            with LoadWindow() as window:
                run = train_bench.train_throughput(
                    data_dir, cfg["train_steps"], None, TRAIN_NAMES[dtype], tag=f"-{round_index}"
                )
            runs[dtype].append({**run, "load": window.report()})
    rates = {d: statistics.median(r["tokens_per_s"] for r in runs[d]) for d in DTYPES}
    return {
        "recipe": "eagle3_smollm2, 1 process, torch's default threads, 4 x 512 tokens per step",
        "steps_per_run": cfg["train_steps"],
        "rounds": cfg["train_rounds"],
        "runs": runs,
        "tokens_per_s_median": {d: round(r, 1) for d, r in rates.items()},
        "speedup_bf16_vs_fp32": round(rates["bfloat16"] / rates["float32"], 3),
    }


# ---- 3. held-out acceptance -----------------------------------------------------------------------------------
def data_gen_command(cfg: dict[str, Any], out: Path, dtype: str, root: Path) -> list[str]:
    return [
        fp8_bench.PY,
        "data_gen/run.py",
        f"recipe={fp8_bench.RECIPE}",
        f"data_gen.output_dir={out}",
        f"data.max_conversations={cfg['al_conversations']}",
        f"data.max_length={cfg['al_max_length']}",
        f"data.heldout_fraction={cfg['al_heldout_fraction']}",
        f"verifier.dtype={dtype}",
        "data_gen.storage_dtype=bfloat16",
        f"run_dir={root / f'data_gen_run_{dtype}'}",
    ]


def train_overrides(cfg: dict[str, Any], dtype: str) -> list[str]:
    """What the AL runs add to fp8_bench's training command: the dtype, equal steps, the capture's length."""
    return [
        f"train.dtype={TRAIN_NAMES[dtype]}",
        f"train.max_steps={cfg['al_max_steps']}",
        f"data.max_length={cfg['al_max_length']}",
        f"eval.max_samples={cfg['al_eval_samples']}",
    ]


def acceptance(cfg: dict[str, Any], root: Path) -> dict[str, Any]:
    """Held-out simulated AL of drafts made entirely in fp32 and in bf16, two seeds each, equal steps."""
    seconds: dict[str, float] = {}
    data = {dtype: root / f"data_{dtype}" for dtype in DTYPES}
    missing = [d for d, out in data.items() if not (out / "train" / "manifest.json").is_file()]
    with ThreadPoolExecutor(2) as pool:  # both captures side by side, one thread each
        futures = {
            dtype: pool.submit(
                fp8_bench.run_stage,
                data_gen_command(cfg, data[dtype], dtype, root),
                root / "logs" / f"data_gen_{dtype}.log",
            )
            for dtype in missing
        }
        for dtype, future in futures.items():
            seconds[f"data_gen_{dtype}"] = round(future.result(), 1)
    jobs = {f"{dtype}_seed{seed}": (dtype, seed) for seed in SEEDS for dtype in DTYPES}  # pairs side by side
    pending = {n: j for n, j in jobs.items() if not (root / n / "checkpoints" / "best.json").is_file()}
    with ThreadPoolExecutor(2) as pool:  # two single-thread runs at a time: one fp32 beside one bf16
        futures = {
            name: pool.submit(
                fp8_bench.run_stage,
                [*fp8_bench.train_command(data[dtype], root / name, 1, seed), *train_overrides(cfg, dtype)],
                root / "logs" / f"train_{name}.log",
            )
            for name, (dtype, seed) in pending.items()
        }
        for name, future in futures.items():
            seconds[f"train_{name}"] = round(future.result(), 1)
    runs = {name: fp8_bench.run_summary(root / name) for name in jobs}
    per_dtype = {d: [runs[f"{d}_seed{s}"]["acceptance_length"] for s in SEEDS] for d in DTYPES}
    means = {d: statistics.mean(v) for d, v in per_dtype.items()}
    spread = max(abs(v[0] - v[1]) for v in per_dtype.values())
    difference = means["bfloat16"] - means["float32"]
    tokens = {d: json.loads((data[d] / "train" / "manifest.json").read_text())["num_tokens"] for d in DTYPES}
    return {
        "recipe": fp8_bench.RECIPE,
        "conversations": cfg["al_conversations"],
        "max_length": cfg["al_max_length"],
        "max_steps": cfg["al_max_steps"],
        "eval_max_samples": cfg["al_eval_samples"],
        "train_tokens": tokens,
        "runs": runs,
        "acceptance_length": per_dtype,
        "mean_acceptance_length": means,
        "difference_bf16_minus_fp32": difference,
        "seed_spread": spread,
        "within_seed_noise": abs(difference) <= spread,
        "seconds": seconds,
        "note": "simulated held-out AL (trainer's evaluation, k = train.ttt_steps); each draft validated on the "
        "held-out features of its own capture dtype; seed_spread = the largest |seed 0 - seed 1| of either dtype",
    }


def run(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (< 4 min): proves every stage")
    parser.add_argument(
        "--root", default=None, help="working directory (default outputs/bench_dtype[_quick])"
    )
    parser.add_argument(
        "--output", default=None, help="result file (default bench/results/dtype[_quick].json)"
    )
    args = parser.parse_args(argv)
    mode = "quick" if args.quick else "full"
    suffix = "_quick" if args.quick else ""
    cfg = SETTINGS[mode]
    root = Path(args.root or REPO / "outputs" / f"bench_dtype{suffix}").resolve()
    output = Path(args.output or REPO / "bench" / "results" / f"dtype{suffix}.json")
    started = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "fp32 vs bf16 compute: capture and draft-training tokens/s side by side, held-out AL",
        "mode": mode,
        "command": " ".join(
            [".venv/bin/python", "bench/dtype_bench.py", *(["--quick"] if args.quick else [])]
        ),
        "machine": machine(),
        "settings": cfg,
    }
    print(f"[dtype bench] capture ({mode})", flush=True)
    result["capture"] = capture_throughput(cfg)
    print(f"[dtype bench] training: {result['capture']['speedup_bf16_vs_fp32']}x capture", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        result["training"] = training_throughput(cfg, Path(tmp))
    print(f"[dtype bench] acceptance: {result['training']['speedup_bf16_vs_fp32']}x training", flush=True)
    result["acceptance"] = acceptance(cfg, root)
    result["speedups_bf16_vs_fp32"] = {
        "capture": result["capture"]["speedup_bf16_vs_fp32"],
        "training": result["training"]["speedup_bf16_vs_fp32"],
    }
    result["total_wall_s"] = round(time.perf_counter() - started, 1)
    atomic_write_json(output, scrub(result, REPO))
    for name in DTYPES:
        shutil.rmtree(root / f"data_gen_run_{name}" / "hydra", ignore_errors=True)
    print(json.dumps({k: result[k] for k in ("speedups_bf16_vs_fp32", "total_wall_s")}, indent=1))
    print(f"[dtype bench] wrote {output}")
    return 0


# ---- its section of bench/results/SUMMARY.md ------------------------------------------------------------------
RESULTS = ("dtype", "dtype_quick")  # the result files this bench writes (bench/results/<stem>.json)


def render(result: dict[str, Any]) -> list[str]:
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


if __name__ == "__main__":
    raise SystemExit(run())
