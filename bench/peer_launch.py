"""Launch ``speculators==0.9.0``'s own trainer on a CPU-only host: the device shim of the peer lane.

Runs under the PEER's interpreter (``.venv-speculators/bin/python``), never ours, and imports nothing from this
repository: ``bench/peer_lane.py`` starts it as a subprocess. Usage::

    python bench/peer_launch.py --threads 1 --steps 180 --report R.json --metrics M.jsonl -- <speculators train flags>

The peer assumes an accelerator. Its trainer moves the model and every batch to ``get_local_rank()`` (the int 0,
i.e. ``cuda:0``) and its step timer calls ``torch.accelerator.synchronize()``, which raises when no accelerator
exists. The shim changes exactly those two things, and only when no accelerator is present: the trainer's
``get_local_rank`` returns the CPU device, and ``synchronize`` is a no-op (CPU ops are synchronous). Nothing else
of the peer is patched: its model, loss, optimizer, scheduler, data loader and checkpoint writer run as shipped.
(Its autocast on device type "cuda" is disabled by torch with a warning on CPU; the lane runs fp32 features, so
that changes nothing.)

Read-only additions: the peer's ``max_steps`` only stops an epoch, not the run (each later epoch would still
take one step), so the launcher sets ``--epochs`` to the fewest epochs of the peer's own packing sampler that hold
``--steps`` batches; and a logging handler copies the peer's metric records (losses, learning rate) to a JSONL file, each stamped with the process's
CPU-seconds so far.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time


class JsonlMetrics(logging.Handler):
    """Appends every dict record of the peer's ``speculators.metrics`` logger (except its hparams dump) as JSON,
    with ``cpu_s``: this process's CPU-seconds when the record was logged (the peer logs a training record after
    every optimizer step, so consecutive records give the CPU of one step: how the lane fits a CPU budget)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        if not isinstance(record.msg, dict) or getattr(record, "hparams", False):
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps({**record.msg, "cpu_s": time.process_time()}, default=str) + "\n")


def install_cpu_shim() -> bool:
    """Point the peer's trainer at the CPU when there is no accelerator; returns whether the shim was applied."""
    import torch

    if torch.accelerator.is_available():
        return False
    import speculators.train.trainer as peer_trainer

    cpu = torch.device("cpu")
    peer_trainer.get_local_rank = lambda: cpu
    torch.accelerator.synchronize = lambda device=None: None
    return True


def capture_metrics(path: str) -> None:
    """Add the JSONL handler right after the peer configures its metric logger (its dictConfig resets handlers)."""
    import speculators.train.cli as peer_cli

    original = peer_cli.setup_metric_logger

    def setup_then_capture(*args, **kwargs):
        original(*args, **kwargs)
        logging.getLogger("speculators.metrics").addHandler(JsonlMetrics(path))

    peer_cli.setup_metric_logger = setup_then_capture


def plan_epochs(cfg, steps: int) -> dict:
    """Epochs of the peer's own packing sampler needed for ``steps`` batches, and what those batches hold."""
    from datasets import load_from_disk
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    lengths = load_from_disk(cfg.data.data_path).with_format(None)["seq_len"]
    train_lengths = lengths[: int(len(lengths) * cfg.data.train_data_ratio)]
    sampler = MultipackDistributedBatchSamplerV2(
        batch_max_length=cfg.data.total_seq_len, lengths=train_lengths, num_replicas=1, rank=0, seed=cfg.seed
    )
    batches: list[list[int]] = []
    epochs = 0
    while len(batches) < steps:
        sampler.set_epoch(epochs)
        batches += [list(map(int, batch)) for batch in sampler]
        epochs += 1
    used = batches[:steps]
    tokens = [min(sum(train_lengths[i] for i in batch), cfg.data.total_seq_len) for batch in used]
    return {
        "epochs": epochs,
        "train_samples": len(train_lengths),
        "batches_per_epoch_first": len(sampler._generate_batches(0)),  # noqa: SLF001
        "samples_per_step_mean": sum(map(len, used)) / max(len(used), 1),
        "samples_trained": sum(map(len, used)),
        "tokens_trained": sum(tokens),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps (the peer's --max-steps)")
    parser.add_argument(
        "--report", required=True, help="JSON written here: the shim, epochs, samples, seconds"
    )
    parser.add_argument("--metrics", required=True, help="JSONL of the peer's metric records")
    parser.add_argument("peer_args", nargs=argparse.REMAINDER, help="-- then the `speculators train` flags")
    args = parser.parse_args()
    peer_args = args.peer_args[1:] if args.peer_args[:1] == ["--"] else args.peer_args

    import torch

    torch.set_num_threads(args.threads)
    from speculators.train.cli import main as peer_main
    from speculators.train.config import TrainConfig

    shimmed = install_cpu_shim()
    capture_metrics(args.metrics)
    cfg = TrainConfig.resolve(peer_args)
    plan = plan_epochs(cfg, args.steps)
    cfg.trainer.epochs = plan["epochs"]
    cfg.trainer.max_steps = args.steps
    start = time.perf_counter()
    peer_main(cfg)
    report = {
        "cpu_shim_applied": shimmed,
        "threads": torch.get_num_threads(),
        "train_seconds": time.perf_counter() - start,
        "peer_argv": peer_args,
        **plan,
    }
    tmp = args.report + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(report, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, args.report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
