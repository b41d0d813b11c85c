"""Benchmark of the training stage.

1. Training throughput of the SmolLM2 draft (the ``eagle3_smollm2`` recipe as the benches measured it,
   ``bench.record.as_measured``: hidden 576, 9/3 heads, draft vocab 8192, 2 TTT steps, micro batches of 4 samples
   of 512 tokens) through the real trainer loop on this machine, fp32, single process: optimizer steps/s and
   tokens/s. Features are random tensors of SmolLM2's shapes written with data_gen's store (their values do not
   change the cost); the targets come from the real SmolLM2 final norm and lm_head. Measured with 1 intra-op thread
   and with torch's default.
   Then the step cost of the demo recipes as they are now (EAGLE-3 and P-EAGLE, one sample per step, 1 thread, the
   `auto` dtype) with each cost lever set either way: torch's per-tensor AdamW loop vs its fused kernel, and the
   full-vocabulary argmax (out-of-vocab targets dropped) vs none (kept). One lever setting of each pair is the
   recipe's own, so that row repeats the default: how far it lands from 1.00 is the measurement's noise.
2. Peak memory of the TTT attention (forward + backward, k = 3 steps, SmolLM2's head layout) as the sequence length
   doubles, for the linear-memory ``chunked`` implementation and the naive dense-mask reference. Counted as live
   tensor bytes (train.memory_plan.LiveBytes), exact and allocator-independent. The chunked ratio per doubling
   must stay near 2 (linear); the dense one approaches 4 (quadratic).

    .venv/bin/python bench/train_bench.py [--steps 6] [--lengths 512 1024 2048 4096] [--dense-max 2048]

Writes bench/results/train.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.record import REPO, as_measured, bullet, command, machine, write_result
from train.memory_plan import LiveBytes
from train.ttt_attention import chunked_ttt_attention, dense_ttt_attention


def peak_memory_of(work) -> int:
    """Peak live tensor bytes of ``work()`` (the counter tests.support.memory wraps; the benchmark uses the
    installed ``train`` package directly rather than importing the test tree)."""
    with LiveBytes() as tracker:
        work()
    return tracker.peak


HEADS, KV_HEADS, HEAD_DIM, TTT_STEPS = 9, 3, 64, 3  # SmolLM2-135M


# ---- 1. throughput ------------------------------------------------------------------------------------------
def write_random_features(directory: Path, samples: int, length: int) -> None:
    """A train split of SmolLM2-shaped random features (+ token counts) through data_gen's store."""
    from safetensors.torch import save_file

    from data_gen.store import TOKEN_COUNTS_NAME, Sample, finalize_split, write_shard
    from speculators.verifier import verifier_config_dict

    config = verifier_config_dict("smollm2")
    hidden, vocab, layers = (
        int(config["hidden_size"]),
        int(config["vocab_size"]),
        int(config["num_hidden_layers"]),
    )
    aux_ids = [2, layers // 2, layers - 3]
    gen = torch.Generator().manual_seed(0)
    rows, counts = [], torch.zeros(vocab, dtype=torch.int64)
    for index in range(samples):
        ids = torch.randint(0, vocab, (length,), generator=gen)
        mask = torch.zeros(length, dtype=torch.bool)
        mask[length // 4 :] = True
        counts += torch.bincount(ids[mask], minlength=vocab)
        aux = torch.randn(length, 3 * hidden, generator=gen)
        last = torch.randn(length, hidden, generator=gen) * 3
        rows.append(Sample(f"bench-{index}", ids, mask, aux, last))
    write_shard(directory / "train", 0, rows, 3, "bfloat16")
    header = {
        "aux_layer_ids": aux_ids,
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "vocab_size": vocab,
        "storage_dtype": "bfloat16",
        "verifier": {"name_or_path": "smollm2"},
    }
    finalize_split(directory / "train", 1, header)
    save_file({"counts": counts}, str(directory / TOKEN_COUNTS_NAME), metadata={"provenance": "{}"})


THROUGHPUT_SHAPE = ["train.max_length=1024", "train.micro_batch_size=4"]


def train_throughput(
    data_dir: Path,
    steps: int,
    threads: int | None,
    dtype: str = "fp32",
    tag: str = "",
    recipe: str = "eagle3_smollm2",
    extra: list[str] | None = None,
    pinned: bool = True,
) -> dict:
    """Steps/s and tokens/s of the real trainer on ``data_dir`` in ``dtype`` (train.dtype: fp32 | bf16 | auto);
    ``tag`` keeps the run directories of repeated measurements apart; ``extra``: the batch shape and any other
    overrides (default :data:`THROUGHPUT_SHAPE`); ``pinned``: the recipe as the benches measured it
    (``bench.record.as_measured``) rather than as it is now."""
    from hydra import compose, initialize_config_dir

    from train.trainer import reset_distributed, train

    run_dir = data_dir.parent / f"run-{recipe}-{threads or 'default'}-{dtype}{tag}"
    overrides = [
        f"recipe={recipe}",
        *(as_measured(recipe) if pinned else []),
        f"train.data_dir={data_dir}",
        f"run_dir={run_dir}",
        f"train.max_steps={steps}",
        *(THROUGHPUT_SHAPE if extra is None else extra),
        "train.save_every=1000000",
        "train.eval_every=1000000",
        f"train.dtype={dtype}",
        "logging=disabled",
        "logging.log_every=1",
        "logging.progress_bar=false",
    ]
    if threads:
        overrides.append(f"train.cpu_threads={threads}")
    before = torch.get_num_threads()
    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    started = time.time()
    try:
        train(cfg, run_dir)
    finally:
        reset_distributed()
        torch.set_num_threads(before)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["kind"] == "train" and r["step"] > 1]  # step 1 warms up
    tokens_per_step = statistics.mean(r["tokens"] for r in timed)
    seconds_per_step = statistics.median(r["tokens"] / r["tokens_per_s"] for r in timed)
    return {
        "threads": threads or before,
        "steps_timed": len(timed),
        "tokens_per_step": tokens_per_step,
        "seconds_per_step_median": round(seconds_per_step, 3),
        "tokens_per_s": round(tokens_per_step / seconds_per_step, 1),
        "wall_seconds_total": round(time.time() - started, 1),
    }


# step cost: what one optimizer step of each recipe (as it is now, no bench pins) costs with each lever set either
# way, at the recipe's own batch (one 512-token sample), one thread, the compute dtype `auto` picks, repeats
# interleaved
STEP_COST_RECIPES = ("eagle3_smollm2", "peagle_smollm2")
STEP_COST_VARIANTS = {
    "default": [],
    "per_tensor_adamw": ["optim.fused=false"],  # torch's default AdamW loop on a CPU
    "out_of_vocab_dropped": ["train.mask_out_of_vocab=true"],  # the full-vocabulary argmax in every step
    "out_of_vocab_kept": ["train.mask_out_of_vocab=false"],  # no full-vocabulary argmax
}


def step_costs(data_dir: Path, steps: int, repeats: int = 2) -> dict[str, Any]:
    """Seconds per optimizer step (median over the timed steps, then over the repeats) of every recipe x variant,
    and each variant's cost relative to the default."""
    runs: dict[str, dict[str, list[float]]] = {
        r: {v: [] for v in STEP_COST_VARIANTS} for r in STEP_COST_RECIPES
    }
    for repeat in range(repeats):
        for recipe in STEP_COST_RECIPES:
            for variant, overrides in STEP_COST_VARIANTS.items():
                shape = ["train.max_length=512", "train.micro_batch_size=1", *overrides]
                got = train_throughput(
                    data_dir, steps, 1, "auto", f"-{variant}-{repeat}", recipe, shape, pinned=False
                )
                runs[recipe][variant].append(got["seconds_per_step_median"])
    table = {}
    for recipe, variants in runs.items():
        base = statistics.median(variants["default"])
        table[recipe] = {
            variant: {
                "seconds_per_step": round(statistics.median(times), 3),
                "runs": times,
                "relative_to_default": round(statistics.median(times) / base, 3),
            }
            for variant, times in variants.items()
        }
    return {
        "how": "the real trainer, each recipe as it is now, 1 thread, train.dtype=auto, one 512-token sample per "
        f"step (the recipes' own batch), {steps} steps per run (the first excluded), {repeats} interleaved repeats; "
        "the variant equal to a recipe's own setting repeats its default (the noise)",
        "variants": {name: overrides for name, overrides in STEP_COST_VARIANTS.items()},
        "recipes": table,
    }


# ---- 2. TTT attention memory --------------------------------------------------------------------------------
def attention_peak(fn, length: int) -> int:
    gen = torch.Generator().manual_seed(length)
    doc = torch.zeros(1, length, dtype=torch.long)
    qs = [
        torch.randn(1, HEADS, length, HEAD_DIM, generator=gen, requires_grad=True) for _ in range(TTT_STEPS)
    ]
    ks = [
        torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=gen, requires_grad=True)
        for _ in range(TTT_STEPS)
    ]
    vs = [
        torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=gen, requires_grad=True)
        for _ in range(TTT_STEPS)
    ]

    def work() -> None:
        outs = [fn(qs[j], ks[: j + 1], vs[: j + 1], doc) for j in range(TTT_STEPS)]
        sum(o.sum() for o in outs).backward()

    return peak_memory_of(work)


def attention_memory(lengths: list[int], dense_max: int, chunk: int) -> dict:
    chunked = {
        n: attention_peak(lambda q, k, v, d: chunked_ttt_attention(q, k, v, d, chunk), n) for n in lengths
    }
    dense = {n: attention_peak(dense_ttt_attention, n) for n in lengths if n <= dense_max}

    def table(peaks: dict[int, int]) -> list[dict]:
        rows, previous = [], None
        for n, peak in peaks.items():
            rows.append(
                {
                    "length": n,
                    "peak_mib": round(peak / 2**20, 2),
                    "ratio_to_half_length": round(peak / previous, 3) if previous else None,
                }
            )
            previous = peak
        return rows

    ratios = [r["ratio_to_half_length"] for r in table(chunked) if r["ratio_to_half_length"]]
    return {
        "steps": TTT_STEPS,
        "heads": HEADS,
        "kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "chunk": chunk,
        "chunked": table(chunked),
        "dense_reference": table(dense),
        "chunked_grows_linearly": all(r < 2.3 for r in ratios),
    }


def run(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--dense-max", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--output", default=str(REPO / "bench" / "results" / "train.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results: dict = {
        "command": command("bench/train_bench.py", argv),
        "machine": {**machine(), "load_average_at_start": os.getloadavg()},
    }
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        write_random_features(data_dir, samples=4 * (args.steps + 1), length=512)
        results["throughput"] = {
            "recipe": "eagle3_smollm2 (fp32, 1 process, chunked TTT attention, 4 x 512 tokens per step)",
            "runs": [train_throughput(data_dir, args.steps, threads) for threads in (1, None)],
        }
        results["step_cost"] = step_costs(data_dir, args.steps)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    results["ttt_attention_memory"] = attention_memory(args.lengths, args.dense_max, args.chunk)
    torch.set_num_threads(threads)
    results["machine"]["load_average_at_end"] = os.getloadavg()
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_result(output, results)
    print(json.dumps(results, indent=2))


# ---- its section of bench/results/SUMMARY.md ------------------------------------------------------------------
RESULTS = ("train",)  # the result files this bench writes (bench/results/<stem>.json)


def render(result: dict[str, Any]) -> list[str]:
    """train.json's section of SUMMARY.md."""
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
    for recipe, variants in (result.get("step_cost") or {}).get("recipes", {}).items():
        lines.append(
            bullet(
                f"seconds per step, {recipe} (relative to its default)",
                {
                    v: f"{row['seconds_per_step']} ({row['relative_to_default']})"
                    for v, row in variants.items()
                },
            )
        )
    return lines


if __name__ == "__main__":
    run()
