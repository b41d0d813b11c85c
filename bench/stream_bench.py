"""Benchmark of streamed training: trainer tokens/s with features streamed by a capture producer beside it
(``train.data_mode=stream``), against the same training from offline shards (``offline``), on SmolLM2
(recipe ``eagle3_smollm2``), CPU, one trainer process.

Both runs train the same samples in the same order (the streamed run recaptures them through the spool). The
streamed trainer starts once its producers have filled the spool or captured everything ("the producer keeps
up"), so the figure is the steady state: does reading the spool, acknowledging items and sharing the machine with
a producer slow the trainer? Goal: streamed >= 0.9 x offline tokens/s. The spool holds less than the run's
features (``--spool-gb``), so the producer keeps capturing while the trainer trains.

Throughput is wall time over ``Trainer.fit`` (every optimizer step plus the one final checkpoint, no held-out
evaluation), tokens from the run's metrics. Other processes' CPU during each window comes from bench/machine_load.

    .venv/bin/python bench/stream_bench.py [--conversations 200] [--epochs 1] [--trainer-threads 1]
        [--producers 1] [--producer-threads 1] [--spool-gb 0.1] [--output bench/results/stream.json]

Smallest setting (a check that it runs, not a figure): ``--conversations 6 --output /tmp/stream_smoke.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.machine_load import LoadWindow
from bench.record import DEMO_RECIPE, REPO, as_measured, bullet, num
from bench.record import machine as bench_machine
from speculators.atomic import atomic_write_json


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def recipe(root: Path, args: argparse.Namespace, mode: str) -> list[str]:
    return [
        f"recipe={DEMO_RECIPE}",
        *as_measured(DEMO_RECIPE),
        f"data.max_conversations={args.conversations}",
        "data.heldout_fraction=0.0",  # no held-out evaluation inside the timed window
        "model.fc_init=default",  # its statistics would come from held-out samples in stream mode
        f"data_gen.output_dir={root / 'data'}",
        f"run_dir={root / mode}",
        "logging=disabled",
        "logging.log_every=1",
        f"train.epochs={args.epochs}",
        f"train.cpu_threads={args.trainer_threads}",
        f"train.data_mode={mode}",
        f"train.data_dir={root / 'data'}",
        f"train.stream.local_producers={args.producers}",
        f"train.stream.producer_threads={args.producer_threads}",
        f"train.stream.max_spool_gb={args.spool_gb}",
        f"train.stream.chunk_steps={args.chunk_steps}",
    ]


def wait_until_producers_keep_up(spool: Path, timeout_s: float) -> float:
    """Seconds until every producer waits on a full spool or has nothing left to capture."""
    started = time.time()
    while time.time() - started < timeout_s:
        beats = []
        for path in (spool / "producers").glob("*.json"):
            try:
                beats.append(json.loads(path.read_text())["doing"])
            except (OSError, json.JSONDecodeError, KeyError):
                pass
        ready = any((spool / "ready").iterdir()) if (spool / "ready").is_dir() else False
        if ready and beats and all(b.startswith(("waiting", "idle")) for b in beats):
            return time.time() - started
        time.sleep(0.5)
    raise TimeoutError(f"the producers did not fill the spool within {timeout_s:.0f} s")


def timed_run(root: Path, args: argparse.Namespace, mode: str) -> dict:
    from train.trainer import Trainer

    cfg = compose(recipe(root, args, mode))
    trainer = Trainer(cfg, root / mode)
    result: dict = {"mode": mode}
    try:
        if mode != "offline":  # publish the plan now (fit repeats it) and let the producers get ahead
            trainer.features.begin(trainer.plan, 0, trainer.total_steps)
            spool = root / mode / "spool"
            result["prefill_s"] = round(wait_until_producers_keep_up(spool, args.prefill_timeout), 1)
        with LoadWindow() as window:
            trainer.fit()
    finally:
        trainer.close()
    records = [json.loads(line) for line in (root / mode / "metrics.jsonl").read_text().splitlines()]
    tokens = sum(r["tokens"] for r in records if r.get("kind") == "train")
    load = window.report()
    result.update(
        {
            "steps": max(r["step"] for r in records if r.get("kind") == "train"),
            "tokens": int(tokens),
            "wall_s": load["wall_s"],
            "tokens_per_s": round(tokens / max(load["wall_s"], 1e-9), 1),
            "machine_load": load,
        }
    )
    return result


def machine() -> dict:
    """The bench-wide machine record (CPU model, native bf16, chosen dtypes) plus the load at the start."""
    return {**bench_machine(), "load_average_at_start": os.getloadavg()}


def run(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=200)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--trainer-threads", type=int, default=1)
    parser.add_argument("--producers", type=int, default=1)
    parser.add_argument("--producer-threads", type=int, default=1)
    parser.add_argument("--spool-gb", type=float, default=0.1)
    parser.add_argument("--chunk-steps", type=int, default=8)
    parser.add_argument("--prefill-timeout", type=float, default=3600.0)
    parser.add_argument("--output", default=str(REPO / "bench" / "results" / "stream.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.trainer_threads)

    from omegaconf import OmegaConf

    from data_gen.pipeline import run_data_gen

    results = {"machine": machine(), "settings": {k: v for k, v in vars(args).items() if k != "output"}}
    root = Path(tempfile.mkdtemp(prefix="stream_bench_"))
    try:
        started = time.time()
        run_data_gen(OmegaConf.to_container(compose(recipe(root, args, "offline")), resolve=True))
        results["offline_capture_s"] = round(time.time() - started, 1)
        offline = timed_run(root, args, "offline")
        stream = timed_run(root, args, "stream")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ratio = stream["tokens_per_s"] / max(offline["tokens_per_s"], 1e-9)
    results.update(
        {
            "offline": offline,
            "stream": stream,
            "stream_over_offline": round(ratio, 3),
            "goal": 0.9,
            "meets_goal": ratio >= 0.9,
            "contended": bool(
                offline["machine_load"].get("contended") or stream["machine_load"].get("contended")
            ),
        }
    )
    results["machine"]["load_average_at_end"] = os.getloadavg()
    atomic_write_json(
        Path(args.output), results
    )  # no local paths: the work dir was temporary and is not named
    print(json.dumps(results, indent=2))


# ---- its section of bench/results/SUMMARY.md ------------------------------------------------------------------
RESULTS = ("stream",)  # the result files this bench writes (bench/results/<stem>.json)


def render(result: dict[str, Any]) -> list[str]:
    """stream.json's section of SUMMARY.md."""
    return [
        bullet("offline training tokens/s", num((result.get("offline") or {}).get("tokens_per_s"))),
        bullet("streamed training tokens/s", num((result.get("stream") or {}).get("tokens_per_s"))),
        bullet("stream over offline", result.get("stream_over_offline")),
        bullet("goal", f">= {result.get('goal')}: {'met' if result.get('meets_goal') else 'NOT met'}"),
        bullet("contended", result.get("contended")),
    ]


if __name__ == "__main__":
    run()
