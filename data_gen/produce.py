"""A capture producer for streamed training: captures the items a trainer needs into its spool (data_gen.spool).

    python -m data_gen.produce --spool <train.stream.spool_dir> [--device cuda:0] [--threads N] [--id NAME]

Start as many as the trainers need, on any machine that sees the spool directory; the trainer also starts
``train.stream.local_producers`` of its own and restarts them when they die. A producer reads everything from the
spool (the trainer's resolved recipe is in ``run.json``), loads the verifier with data_gen's capture (the same code
path as ``data_gen/run.py``), checks that its encoded samples are the trainer's (a digest), then loops: re-queue
the claims of dead producers, claim the next item that fits the byte budget (or wait: back-pressure), capture it,
write it in data_gen.store's verified shard format under ``partial/`` and rename it into ``ready/``. It exits when
the trainer writes ``finished``, when its parent dies (``--parent-pid``), or when the trainer's run changes.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from data_gen.spool import HELDOUT, TAIL, Item, ItemPlan, Spool, item_bytes_bound, sample_digest

log = logging.getLogger("data_gen.produce")


@dataclass
class Job:
    """One item to capture: its name, its place in production order and whether it counts against the budget
    (the tail goes straight to the cache); :meth:`Producer._samples` resolves its samples once it is chosen."""

    item: Item
    order: int
    bounded: bool = True


class Producer:
    """Loads the verifier once, then captures items until the trainer is finished (see the module docstring)."""

    def __init__(self, spool: Spool, name: str, device: str, parent_pid: int | None, poll_s: float = 0.05):
        self.spool, self.name, self.device, self.parent_pid, self.poll_s = (
            spool,
            name,
            device,
            parent_pid,
            poll_s,
        )
        self.doing = "starting"
        self._plan_raw: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._waiting_logged = False

    # ---- set-up -----------------------------------------------------------------------------------------
    def load(self) -> None:
        """Wait for the trainer's run.json, load the verifier side and check the sample list against it."""
        import torch

        from data_gen.pipeline import (
            GenSettings,
            encode_recipe_conversations,
            load_verifier_side,
            run_identity,
            shard_header,
        )
        from data_gen.sources import DataSettings
        from speculators import families
        from speculators.head_check import PROBE_NAME, record_head_probe

        while (run := self.spool.read_json("run.json")) is None:
            self._check_alive()
            time.sleep(0.5)
        self.run = run
        config = run["recipe"]
        data, gen = DataSettings.from_mapping(config["data"]), GenSettings.from_mapping(config["data_gen"])
        self.gen, self.timeout_s = gen, float(run["producer_timeout_s"])
        side = load_verifier_side(dict(config["verifier"]), data, torch.device(self.device), gen)
        side.capture.move_to(self.device)  # streamed modes refuse regeneration: nothing else wants the device
        self.capture = side.capture
        tokenizer = side.tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else side.masker.eot_id
        # the verifier's family: its chat format is the one side.masker (data_gen's) was built with
        family = families.of_config(side.hf_config)
        train, heldout = encode_recipe_conversations(
            config["data"], tokenizer, family.chat, verifier=str(config["verifier"]["name_or_path"])
        )
        self.train, self.heldout = train[: run["num_samples"]], heldout[: run["heldout_count"]]
        if sample_digest(self.train) != run["train_digest"]:
            raise RuntimeError(
                f"{self.spool.root / 'run.json'}: this producer encodes other training samples than the trainer "
                "(the sample digest differs): run it with the same code, data source and tokenizer as the trainer"
            )
        probe = self.spool.root / PROBE_NAME  # the trainer checks its head against it before its first step
        if self.train and not probe.is_file():
            record_head_probe(side.model, self.train[0].input_ids).save(probe)
        header = shard_header(
            side, str(config["verifier"]["name_or_path"]), run_identity(side, data, gen), data, {}
        )
        self.header = header
        self.layout = {
            "num_aux": len(side.aux_layer_ids),
            # a wrapper (Mistral 3, Gemma 4) holds it in its text_config: the flat view, as the trainer reads it
            "hidden_size": int(family.flat_config(side.hf_config.to_dict())["hidden_size"]),
            "storage_dtype": gen.storage_dtype,
        }

    # ---- the loop ---------------------------------------------------------------------------------------
    def run_forever(self) -> None:
        beat = threading.Thread(target=self._heartbeats, daemon=True)
        self.spool.heartbeat(self.name, self.doing)
        beat.start()
        try:
            self.load()
            while not self.spool.finished.exists():
                self._check_alive()
                self.spool.requeue_stale_claims(self.timeout_s)
                chosen = self._next_job()
                if chosen is None:
                    time.sleep(self.poll_s)
                    continue
                self._capture(*chosen)
            log.info("producer %s: the trainer is finished", self.name)
        finally:
            self._stop.set()
            self.spool.forget_producer(self.name)

    def _check_alive(self) -> None:
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            log.info("producer %s: its trainer (pid %d) is gone; exiting", self.name, self.parent_pid)
            raise SystemExit(0)
        run = self.spool.read_json("run.json")
        if hasattr(self, "run") and run is not None and run.get("run_id") != self.run.get("run_id"):
            log.info(
                "producer %s: the spool now serves another run; exiting (restart to serve it)", self.name
            )
            raise SystemExit(0)

    def _heartbeats(self) -> None:
        interval = 1.0
        while not self._stop.wait(interval):
            self.spool.heartbeat(self.name, self.doing)
            interval = min(2.0, getattr(self, "timeout_s", 8.0) / 4)

    def _jobs(self) -> list[Job]:
        """Items that may still be needed, in production order: held-out first, then the ranks' train items
        from their cursors on (a rank without a cursor has not started), then the tail (cache-first-epoch)."""
        jobs = [Job(Item(HELDOUT), -1)] if self.heldout else []
        plan_raw = self.spool.read_json("plan.json")
        if plan_raw is None:
            return jobs
        if plan_raw != self._plan_raw:
            self._plan_raw, self._plan = plan_raw, ItemPlan(plan_raw)
        plan = self._plan
        cursors = {r: self.spool.cursor(r) for r in range(plan.batches.world_size)}
        for order, item in enumerate(plan.train_items()):
            cursor = cursors[item.rank]
            if cursor is not None and item.chunk >= cursor:
                jobs.append(Job(item, order))
        if plan.needs_tail():
            jobs.append(Job(Item(TAIL), 1 << 62, bounded=False))
        return jobs

    def _samples(self, job: Job) -> list[Any]:
        if job.item.name == HELDOUT:
            return self.heldout
        return [self.train[i] for i in self._plan.indices(job.item)]

    def _next_job(self) -> tuple[Job, list[Any]] | None:
        """Under the claim lock: the first item neither done nor claimed, claimed if it fits the budget."""
        if not self.spool.acquire_lock():
            return None
        try:
            # the done set BEFORE the cursors: a trainer moves its cursor on before it deletes a consumed item, so an
            # item missing here was either never made or is behind a cursor read below
            done, claimed = self.spool.finished_items(), self.spool.claimed_items()
            jobs = self._jobs()
            for job in jobs:
                if job.item.name in done or job.item.name in claimed:
                    continue
                samples = self._samples(job)
                reserved = self._bound(job, samples) if job.bounded else 0
                if job.bounded and not self._fits(reserved, job, jobs, done):
                    return None
                self.spool.claim(job.item.name, self.name, reserved)
                self._waiting_logged = False
                return job, samples
            self.doing = "idle: every needed item is ready or claimed"
            return None
        finally:
            self.spool.release_lock()

    def _bound(self, job: Job, samples: list[Any]) -> int:
        tokens = sum(len(s.input_ids) for s in samples)
        return item_bytes_bound(tokens, len(samples), self.layout)

    def _fits(self, reserved: int, job: Job, jobs: list[Job], done: set[str]) -> bool:
        """Whether ``job`` fits the budget now. When it does not and ready items come LATER in production order
        (a trainer resumed at an earlier chunk), the latest one is evicted so the spool cannot deadlock."""
        budget = int(self.run["max_spool_bytes"])
        if reserved > budget:
            raise RuntimeError(
                f"item {job.item.name} needs up to {reserved / 1e9:.4f} GB but train.stream.max_spool_gb allows "
                f"{budget / 1e9:.4f} GB: raise max_spool_gb or lower train.stream.chunk_steps"
            )
        if self.spool.used_bytes() + reserved <= budget:
            return True
        ready = set(self.spool.ready_items())
        later = [j for j in jobs if j.order > job.order and j.bounded and j.item.name in ready]
        if later:
            victim = max(later, key=lambda j: j.order).item.name
            log.warning(
                "spool full while %s is missing: evicting the later item %s (recaptured when due)",
                job.item.name,
                victim,
            )
            self.spool.remove_item(victim)
            return self.spool.used_bytes() + reserved <= budget
        self.doing = f"waiting: spool full ({budget / 1e9:.4f} GB) before {job.item.name}"
        if not self._waiting_logged:
            log.info("producer %s: %s", self.name, self.doing)
            self._waiting_logged = True
        return False

    def _capture(self, job: Job, encoded: list[Any]) -> None:
        import shutil

        from data_gen.pipeline import capture_samples
        from data_gen.store import finalize_split, write_shard

        name = job.item.name
        self.doing = f"capturing {name} ({len(encoded)} samples)"
        started = time.time()
        samples = capture_samples(self.capture, encoded)
        partial = self.spool.partial / f"{name}.{self.name}"
        shutil.rmtree(partial, ignore_errors=True)
        num_aux = len(self.capture.aux_layer_ids)
        extra = {"item": name, "producer": self.name}
        write_shard(partial, 0, samples, num_aux, self.gen.storage_dtype, extra)
        finalize_split(partial, 1, self.header)
        target_base = self.spool.ready if job.bounded else self.spool.cache_dir()
        target_base.mkdir(parents=True, exist_ok=True)
        if not self.spool.claimed_by(name, self.name):  # presumed dead, the item re-queued: drop our copy
            shutil.rmtree(partial, ignore_errors=True)
            return
        try:
            partial.rename(target_base / name)
        except OSError:  # another producer finished it first
            shutil.rmtree(partial, ignore_errors=True)
        finally:
            self.spool.release_claim(name)
        tokens = sum(len(s.input_ids) for s in encoded)
        log.info(
            "producer %s: %s captured, %d tokens in %.1f s", self.name, name, tokens, time.time() - started
        )


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="capture producer for streamed training (data_gen.spool)")
    parser.add_argument("--spool", required=True, help="the trainer's train.stream.spool_dir")
    parser.add_argument("--id", default=None, help="producer name (default: host-pid)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    spool = Spool(args.spool)
    spool.create()
    name = args.id or f"{socket.gethostname()}-{os.getpid()}"
    spool.heartbeat(name, "starting")  # alive before the slow imports (torch, transformers)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    device = default_device() if args.device == "auto" else args.device
    Producer(spool, name, device, args.parent_pid).run_forever()


if __name__ == "__main__":
    sys.exit(main())
