"""The spool: a bounded directory (a shared filesystem across nodes) through which capture producers hand verifier
features to trainers while both run. Coordination is by files alone — atomic renames, exclusive creates and
heartbeats — so producers and trainers can be separate processes or separate nodes, with no socket between them.

Layout (``train.stream.spool_dir``)::

    run.json                  the trainer's run: resolved recipe, sample digest, byte budget, cache dir (rank 0)
    plan.json                 the batch plan (data_gen.batch_plan.BatchPlan's inputs, total steps, chunk steps)
    cursors/rank-00000.json   {"chunk": g}: the lowest global chunk rank r still needs (written by that rank)
    ready/<item>/             a finished item: one shard in data_gen.store's verified format + its manifest
    partial/<item>.<producer> an item being written (renamed into ready/ when whole)
    trash/                    consumed items being deleted (renamed here first, still counted)
    claims/<item>.json        {"producer", "bytes"}: who captures the item and the bytes it reserved
    producers/<id>.json       a producer's heartbeat (its mtime is what counts)
    finished                  the trainer is done: producers exit
    .lock/                    held (mkdir) while a producer checks the budget and claims an item

An ITEM is what one producer captures in one go: ``heldout`` (the validation samples), ``e0003-c00012-r001``
(the samples rank 1 trains on in chunk 12 of epoch 3: ``chunk_steps`` optimizer steps), or ``tail`` (in
cache-first-epoch mode, the samples epoch 0 does not train on, written straight to the cache). Which samples an
item holds follows from ``plan.json`` alone (:class:`ItemPlan`), so every producer and consumer agrees on it.

The byte bound: a producer claims an item only when the bytes in ``ready/`` plus every open claim's reservation
plus this item's estimate (an upper bound) fit ``max_spool_bytes``; otherwise it waits (back-pressure). A ready
item leaves the spool when its rank has consumed it (deleted, or moved to the cache in cache-first-epoch mode).
A claim whose producer's heartbeat is older than ``producer_timeout_s`` (or gone) is re-queued, with a log line.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speculators.atomic import atomic_write_json

log = logging.getLogger("data_gen.spool")

HELDOUT = "heldout"
TAIL = "tail"
LOCK_STALE_S = 30.0  # a claim lock older than this belongs to a dead producer
SHARD_SLACK_BYTES = (
    64 * 1024
)  # safetensors header, record and manifest of one item, beyond the per-sample part
SAMPLE_SLACK_BYTES = 512  # per sample: its id in the header, record and manifest, its offset


class ProducerStarvation(RuntimeError):
    """No capture producer has been alive for ``producer_timeout_s`` while the trainer waits for an item."""


@dataclass(frozen=True)
class Item:
    """One unit of capture work (see the module docstring)."""

    name: str
    epoch: int | None = None
    chunk: int | None = None  # global chunk index: epoch * chunks_per_epoch + chunk in the epoch
    rank: int | None = None

    @classmethod
    def train(cls, epoch: int, chunk_in_epoch: int, global_chunk: int, rank: int) -> Item:
        return cls(f"e{epoch:04d}-c{chunk_in_epoch:05d}-r{rank:03d}", epoch, global_chunk, rank)


class ItemPlan:
    """Which samples each item holds, from ``plan.json`` (the inputs of the trainer's
    :class:`data_gen.batch_plan.BatchPlan`)."""

    def __init__(self, plan: dict[str, Any]) -> None:
        from data_gen.batch_plan import BatchPlan  # torch: imported when a plan is read, not with the spool

        self.raw = plan
        self.batches = BatchPlan(
            plan["num_samples"],
            plan["micro_batch_size"],
            plan["grad_accum"],
            plan["world_size"],
            plan["seed"],
            plan["shuffle"],
        )
        self.total_steps = int(plan["total_steps"])
        self.chunk_steps = int(plan["chunk_steps"])
        self.cache_first_epoch = plan["mode"] == "cache-first-epoch"
        self.per_epoch = self.batches.steps_per_epoch
        self.chunks_per_epoch = math.ceil(self.per_epoch / self.chunk_steps)

    def parse(self, name: str) -> Item | None:
        """The train item called ``name`` (``e0003-c00012-r001``), or None for held-out/tail/other names."""
        parts = name.split("-")
        if len(parts) != 3 or [p[:1] for p in parts] != ["e", "c", "r"]:
            return None
        epoch, chunk, rank = (int(p[1:]) for p in parts)
        return Item.train(epoch, chunk, epoch * self.chunks_per_epoch + chunk, rank)

    def chunk_of_step(self, step: int) -> int:
        """Global chunk index of optimizer step ``step``."""
        epoch, in_epoch = divmod(step, self.per_epoch)
        return epoch * self.chunks_per_epoch + in_epoch // self.chunk_steps

    def item_of(self, epoch: int, step_in_epoch: int, rank: int) -> Item:
        chunk = step_in_epoch // self.chunk_steps
        return Item.train(epoch, chunk, epoch * self.chunks_per_epoch + chunk, rank)

    def streamed_epochs(self) -> int:
        """Epochs whose items go through the spool (cache-first-epoch: only epoch 0)."""
        epochs = math.ceil(self.total_steps / self.per_epoch)
        return min(epochs, 1) if self.cache_first_epoch else epochs

    def train_items(self) -> Iterator[Item]:
        """Every streamed train item in production order (chunk by chunk, ranks interleaved)."""
        for epoch in range(self.streamed_epochs()):
            for chunk in range(self.chunks_per_epoch):
                if self._steps(epoch, chunk):
                    for rank in range(self.batches.world_size):
                        yield Item.train(epoch, chunk, epoch * self.chunks_per_epoch + chunk, rank)

    def needs_tail(self) -> bool:
        """Cache-first-epoch runs that go past epoch 0 need the samples epoch 0 left out."""
        return self.cache_first_epoch and self.total_steps > self.per_epoch

    def _steps(self, epoch: int, chunk: int) -> range:
        first = chunk * self.chunk_steps
        stop = min(first + self.chunk_steps, self.per_epoch, self.total_steps - epoch * self.per_epoch)
        return range(first, max(first, stop))

    def indices(self, item: Item) -> list[int]:
        """Sample indices of a train or tail item, in the order the trainer consumes them."""
        if item.name == TAIL:
            return self.batches.order(0)[self.per_epoch * self.batches.global_batch :].tolist()
        chunk_in_epoch = item.chunk - item.epoch * self.chunks_per_epoch
        return [
            index
            for step in self._steps(item.epoch, chunk_in_epoch)
            for accum in range(self.batches.grad_accum)
            for index in self.batches.micro_indices(item.epoch, step, accum, item.rank)
        ]


def sample_digest(samples: Any) -> str:
    """sha256 over the ids and token ids of encoded samples: producers refuse to capture for another sample list."""
    import hashlib

    digest = hashlib.sha256()
    for sample in samples:
        digest.update(f"{sample.sample_id}:{','.join(map(str, sample.input_ids))}\n".encode())
    return digest.hexdigest()


def item_bytes_bound(tokens: int, samples: int, layout: dict[str, Any]) -> int:
    """An upper bound of an item's bytes on disk: its tokens' features, ids and mask, plus headers and records."""
    width, hidden = int(layout["num_aux"]) * int(layout["hidden_size"]), int(layout["hidden_size"])
    if layout["storage_dtype"] == "fp8":
        per_token = width + hidden + 4 * (int(layout["num_aux"]) + 1)
    else:
        per_token = 2 * (width + hidden)
    return tokens * (per_token + 4 + 1) + samples * (SAMPLE_SLACK_BYTES + 8) + SHARD_SLACK_BYTES


def directory_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:  # removed while we counted
                pass
    return total


class Spool:
    """The files of one spool directory (both sides use it; see the module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.ready, self.partial, self.claims = (
            self.root / "ready",
            self.root / "partial",
            self.root / "claims",
        )
        self.producers, self.cursors = self.root / "producers", self.root / "cursors"
        self.lock, self.finished, self.trash = (
            self.root / ".lock",
            self.root / "finished",
            self.root / "trash",
        )

    def create(self) -> None:
        for path in (self.ready, self.partial, self.claims, self.producers, self.cursors, self.trash):
            path.mkdir(parents=True, exist_ok=True)

    # ---- the run and its plan ---------------------------------------------------------------------------
    def read_json(self, name: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.root / name).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def write_json(self, name: str, payload: dict[str, Any]) -> None:
        atomic_write_json(self.root / name, payload)

    def cache_dir(self) -> Path | None:
        run = self.read_json("run.json") or {}
        return Path(run["cache_dir"]) if run.get("cache_dir") else None

    # ---- cursors ----------------------------------------------------------------------------------------
    def set_cursor(self, rank: int, chunk: int) -> None:
        atomic_write_json(self.cursors / f"rank-{rank:05d}.json", {"chunk": int(chunk)})

    def cursor(self, rank: int) -> int | None:
        try:
            return int(json.loads((self.cursors / f"rank-{rank:05d}.json").read_text())["chunk"])
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            return None

    # ---- items ------------------------------------------------------------------------------------------
    def location(self, item: str) -> Path | None:
        """Where a finished item lies: the spool's ready/, or the cache (cache-first-epoch), or None."""
        for base in (self.ready, self.cache_dir()):
            if base is not None and (base / item / "manifest.json").is_file():
                return base / item
        return None

    def finished_items(self) -> set[str]:
        """Names of the items in ready/ or in the cache (a directory appears there whole, by rename)."""
        cache = self.cache_dir()
        names = set(self.ready_items())
        if cache is not None and cache.is_dir():
            names |= {p.name for p in cache.iterdir()}
        return names

    def ready_items(self) -> list[str]:
        return sorted(p.name for p in self.ready.iterdir()) if self.ready.is_dir() else []

    def remove_item(self, item: str) -> None:
        """Delete a ready item: renamed out of ready/ first, so it never looks half there."""
        source = self.ready / item
        trash = self.trash / f"{item}.{os.getpid()}-{time.monotonic_ns()}"
        try:
            source.rename(trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def move_to_cache(self, item: str) -> None:
        """Keep a consumed item (cache-first-epoch): renamed into the cache, or copied there whole and then
        renamed when the cache is on another filesystem."""
        cache = self.cache_dir()
        cache.mkdir(parents=True, exist_ok=True)
        source = self.ready / item
        if not source.is_dir():  # already moved (a resumed rank consuming the same item again)
            return
        try:
            source.rename(cache / item)
        except OSError:
            staging = cache / f".{item}.partial-{os.getpid()}"
            shutil.rmtree(staging, ignore_errors=True)
            shutil.copytree(source, staging)
            staging.rename(cache / item)
            self.remove_item(item)

    def used_bytes(self) -> int:
        """Bytes in ready/ and trash/ plus the reservations of open claims (a partial item stays within its
        reservation): what the budget is checked against."""
        reserved = 0
        for path in self.claims.glob("*.json"):
            try:
                reserved += int(json.loads(path.read_text())["bytes"])
            except (FileNotFoundError, json.JSONDecodeError, KeyError):
                pass
        return directory_bytes(self.ready) + directory_bytes(self.trash) + reserved

    # ---- producers --------------------------------------------------------------------------------------
    def heartbeat(self, producer: str, doing: str) -> None:
        atomic_write_json(
            self.producers / f"{producer}.json",
            {"producer": producer, "pid": os.getpid(), "host": socket.gethostname(), "doing": doing},
        )

    def forget_producer(self, producer: str) -> None:
        """Drop a producer's heartbeat (its supervisor saw it die): its claims are re-queued at once."""
        (self.producers / f"{producer}.json").unlink(missing_ok=True)

    def heartbeat_age(self, producer: str) -> float | None:
        try:
            return time.time() - (self.producers / f"{producer}.json").stat().st_mtime
        except FileNotFoundError:
            return None

    def live_producers(self, timeout_s: float) -> list[str]:
        if not self.producers.is_dir():
            return []
        names = [p.stem for p in self.producers.glob("*.json")]
        return [n for n in names if (age := self.heartbeat_age(n)) is not None and age <= timeout_s]

    def requeue_stale_claims(self, timeout_s: float) -> list[str]:
        """Re-queue every claim whose producer stopped heartbeating; returns the items, each logged."""
        requeued = []
        for path in sorted(self.claims.glob("*.json")):
            try:
                claim = json.loads(path.read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                continue
            age = self.heartbeat_age(claim["producer"])
            if age is not None and age <= timeout_s:
                continue
            for partial in self.partial.glob(f"{path.stem}.{claim['producer']}*"):
                shutil.rmtree(
                    partial, ignore_errors=True
                )  # first: its bytes stay reserved until they are gone
            try:
                path.unlink()
            except FileNotFoundError:  # someone else re-queued it first
                continue
            seen = "no heartbeat left" if age is None else f"last heartbeat {age:.0f} s ago"
            log.warning(
                "capture producer %s is gone (%s, timeout %.0f s): its claim on %s is re-queued",
                claim["producer"],
                seen,
                timeout_s,
                path.stem,
            )
            requeued.append(path.stem)
        return requeued

    # ---- the claim lock ---------------------------------------------------------------------------------
    def acquire_lock(self) -> bool:
        try:
            self.lock.mkdir()
            return True
        except FileExistsError:
            try:
                if time.time() - self.lock.stat().st_mtime > LOCK_STALE_S:
                    self.lock.rmdir()  # its holder died between mkdir and rmdir
            except FileNotFoundError:
                pass
            return False

    def release_lock(self) -> None:
        try:
            self.lock.rmdir()
        except FileNotFoundError:
            pass

    def claim(self, item: str, producer: str, reserved: int) -> None:
        atomic_write_json(self.claims / f"{item}.json", {"producer": producer, "bytes": int(reserved)})

    def claimed_items(self) -> set[str]:
        return {p.stem for p in self.claims.glob("*.json")}

    def claimed_by(self, item: str, producer: str) -> bool:
        try:
            return json.loads((self.claims / f"{item}.json").read_text())["producer"] == producer
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            return False

    def release_claim(self, item: str) -> None:
        (self.claims / f"{item}.json").unlink(missing_ok=True)


def wait_for_item(
    spool: Spool, item: str, producer_timeout_s: float, poll_s: float = 0.05, what: str = ""
) -> Path:
    """Block until ``item`` is ready; raise :class:`ProducerStarvation` when no producer has been alive for
    ``producer_timeout_s`` (stale claims are re-queued meanwhile, each with a log line)."""
    last_alive = time.monotonic()
    next_check = 0.0
    while (path := spool.location(item)) is None:
        now = time.monotonic()
        if now >= next_check:
            next_check = now + 1.0
            spool.requeue_stale_claims(producer_timeout_s)
            if spool.live_producers(producer_timeout_s):
                last_alive = now
            elif now - last_alive > producer_timeout_s:
                raise ProducerStarvation(
                    f"the trainer waits for {what or item} in the spool {spool.root}, but no capture producer has "
                    f"sent a heartbeat for {producer_timeout_s:.0f} s (train.stream.producer_timeout_s). Start "
                    f"producers with `python -m data_gen.produce --spool {spool.root}` on a machine that sees this "
                    "directory, or set train.stream.local_producers >= 1; their logs are under "
                    f"{spool.root / 'logs'}"
                )
        time.sleep(poll_s)
    return path


__all__ = [
    "HELDOUT",
    "TAIL",
    "Item",
    "ItemPlan",
    "ProducerStarvation",
    "Spool",
    "directory_bytes",
    "item_bytes_bound",
    "sample_digest",
    "wait_for_item",
]
