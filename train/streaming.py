"""Streamed features: ``train.data_mode=stream`` and ``cache-first-epoch`` (docs/streaming.md).

Capture producers (:mod:`data_gen.produce`, started here and/or on other nodes) write the items the trainer needs
into a bounded spool directory (:mod:`data_gen.spool`); this source reads them in the order of the run's
:class:`data_gen.batch_plan.BatchPlan`, so a streamed epoch trains exactly the samples an offline epoch does, and
removes each item once its rank has consumed it (cache-first-epoch: moves epoch 0's items to the cache instead,
and later epochs read the cache like offline shards).

Exact resume: the data position is the optimizer step, as offline. :meth:`StreamFeatures.begin` points this
rank's cursor at the chunk of the resumed step; items consumed after the last checkpoint were removed from the
spool and are captured again (the same samples, in the same order). A producer that dies is restarted here
(:class:`ProducerPool`) or replaced by any other; its claimed item is re-queued after its heartbeat times out
(at once when this supervisor saw it exit), and the trainer raises :class:`data_gen.spool.ProducerStarvation`
when no producer at all is alive.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from data_gen.batch_plan import BatchPlan
from data_gen.spool import (
    HELDOUT,
    TAIL,
    Item,
    ItemPlan,
    Spool,
    item_bytes_bound,
    sample_digest,
    wait_for_item,
)
from speculators.head_check import PROBE_NAME, HeadProbe
from train.data import MicroBatch
from train.features import FeatureSource, RowLayout, TokenDataset
from train.settings import TrainSettings
from train.targets import TargetHead

log = logging.getLogger("train.streaming")
REPO_ROOT = Path(__file__).resolve().parents[1]
ACK = "spool_ack"  # key of the sample that closes an item: (item name, global chunk)


def _feature_dataset(path: Path):
    from data_gen.store import FeatureDataset

    return FeatureDataset(path, dequantize=False)


class SpoolSamples(Dataset):
    """The training samples, read by epoch from the spool (or the epoch-0 cache): :meth:`epoch_samples` is what
    :class:`train.data.MicroBatchStream` calls. Picklable: DataLoader workers read items themselves."""

    def __init__(self, spool: Spool, ids: list[str], rank: int, timeout_s: float) -> None:
        self.spool, self.ids, self.rank, self.timeout_s = spool, ids, rank, timeout_s
        self.plan: ItemPlan | None = None
        self._open: dict[str, tuple[Any, dict[int, int], int]] = {}
        self._positions: tuple[int, torch.Tensor] | None = None
        self._cache: dict[str, tuple[str, int]] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        raise TypeError("streamed samples are read per epoch (epoch_samples), not by index")

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_open": {}, "_cache": None}

    def epoch_samples(self, epoch: int, indices: list[int]) -> list[dict[str, Any]]:
        plan = self.plan
        if plan.cache_first_epoch and epoch >= 1:
            return [self._cached(index) for index in indices]
        position = int(self._epoch_positions(epoch)[indices[0]])
        item = plan.item_of(epoch, position // plan.batches.global_batch, self.rank)
        dataset, local, last = self._item(item)
        samples = [self._checked(dataset[local[index]], index, item.name) for index in indices]
        if indices[-1] == last:  # this micro group closes the item: the main process acks it after using it
            samples[0][ACK] = (item.name, item.chunk)
            self._open.pop(item.name, None)
        return samples

    def _epoch_positions(self, epoch: int) -> torch.Tensor:
        if self._positions is None or self._positions[0] != epoch:
            order = self.plan.batches.order(epoch)
            positions = torch.empty_like(order)
            positions[order] = torch.arange(len(order))
            self._positions = (epoch, positions)
        return self._positions[1]

    def _item(self, item: Item) -> tuple[Any, dict[int, int], int]:
        if item.name not in self._open:
            path = wait_for_item(self.spool, item.name, self.timeout_s, what=f"item {item.name}")
            indices = self.plan.indices(item)
            self._open[item.name] = (
                _feature_dataset(path),
                {index: n for n, index in enumerate(indices)},
                indices[-1],
            )
        return self._open[item.name]

    def _checked(self, sample: dict[str, Any], index: int, item: str) -> dict[str, Any]:
        if sample["sample_id"] != self.ids[index]:
            raise ValueError(
                f"spool item {item} ({self.spool.root}) holds sample {sample['sample_id']!r} where the plan "
                f"expects {self.ids[index]!r}: it was written for another run; delete {self.spool.root} and restart"
            )
        return sample

    def _cached(self, index: int) -> dict[str, Any]:
        """Epochs >= 1 of cache-first-epoch: the cached items of every rank, plus the tail, indexed by id."""
        if self._cache is None:
            names = [item.name for item in self.plan.train_items()] + (
                [TAIL] if self.plan.needs_tail() else []
            )
            where: dict[str, tuple[str, int]] = {}
            for name in names:
                path = wait_for_item(self.spool, name, self.timeout_s, what=f"cached item {name}")
                for local, sample_id in enumerate(_feature_dataset(path).sample_ids):
                    where[sample_id] = (str(path), local)
            self._cache = where
        path, local = self._cache[self.ids[index]]
        if path not in self._open:
            self._open[path] = (_feature_dataset(Path(path)), {}, -1)
        return self._checked(self._open[path][0][local], index, Path(path).name)


class HeldoutSamples(Dataset):
    """The held-out samples, captured once into the spool's ``heldout`` item (kept for the whole run)."""

    def __init__(self, spool: Spool, count: int, timeout_s: float) -> None:
        self.spool, self.count, self.timeout_s = spool, count, timeout_s
        self._dataset = None

    def __len__(self) -> int:
        return self.count

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_dataset": None}

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self._dataset is None:
            path = wait_for_item(self.spool, HELDOUT, self.timeout_s, what="the held-out item")
            self._dataset = _feature_dataset(path)
        return self._dataset[index]


class StreamCollate:
    """Packs a micro group and carries its acknowledgement (the item it closes) to the main process."""

    def __init__(self, layout: RowLayout) -> None:
        self.layout = layout

    def __call__(self, samples: list[dict[str, Any]]) -> tuple[MicroBatch, tuple[str, int] | None]:
        ack = next((s.pop(ACK) for s in samples if ACK in s), None)
        return self.layout.pack(samples), ack


class StreamFeatures(FeatureSource):
    """Features captured while training (see the module docstring)."""

    def __init__(
        self, settings: TrainSettings, accelerator, layout: RowLayout, verifier_config: dict[str, Any]
    ) -> None:
        from transformers import AutoTokenizer

        from data_gen.capture import resolve_aux_layer_ids
        from data_gen.pipeline import encode_recipe_conversations
        from speculators import families
        from speculators.verifier import resolve_verifier_path
        from speculators.vocab import tokenizer_fingerprint

        super().__init__(settings, accelerator, layout)
        regenerate = (settings.resolved.get("data_gen") or {}).get("regenerate") or {}
        if regenerate.get("enabled"):
            raise ValueError(
                f"data_gen.regenerate.enabled=true with train.data_mode={settings.train.data_mode}: producers "
                "capture the conversations as given; regenerate with data_gen first, or disable regeneration"
            )
        self.verifier_config = verifier_config
        stream, run_dir = settings.train.stream, Path(str(settings.resolved.get("run_dir", ".")))
        self.spool = Spool(Path(stream.spool_dir or run_dir / "spool").absolute())
        self.cache_dir = Path(stream.cache_dir or run_dir / "stream_cache").absolute()
        self.timeout_s = stream.producer_timeout_s
        tokenizer = AutoTokenizer.from_pretrained(resolve_verifier_path(settings.verifier.name_or_path))
        chat = families.of_config(verifier_config).chat  # as data_gen masks for this verifier
        train, heldout = encode_recipe_conversations(
            settings.data, tokenizer, chat, verifier=settings.verifier.name_or_path
        )
        self.counts = TokenDataset(train).token_counts(int(verifier_config["vocab_size"]))
        train = train[: settings.train.max_samples] if settings.train.max_samples else train
        limit = settings.eval.max_samples
        heldout = heldout[:limit] if limit else heldout
        self.provenance = {
            "source": settings.train.data_mode,
            "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        }
        self.aux_layer_ids = resolve_aux_layer_ids(
            settings.verifier.aux_layer_ids, int(verifier_config["num_hidden_layers"])
        )
        self.train_set = SpoolSamples(self.spool, [s.sample_id for s in train], self.rank, self.timeout_s)
        self.heldout_set = HeldoutSamples(self.spool, len(heldout), self.timeout_s) if heldout else None
        self.collate = StreamCollate(layout)
        self._lengths = [len(s.input_ids) for s in train]
        self._heldout_tokens = sum(len(s.input_ids) for s in heldout)
        self.pool = None
        if self.rank == 0:
            self._open_spool(train, len(heldout))
            if stream.local_producers:
                self.pool = ProducerPool(self.spool, stream, self.timeout_s)
                self.pool.start()
        accelerator.wait_for_everyone()

    def _open_spool(self, train: list[Any], heldout_count: int) -> None:
        """Rank 0: describe the run in ``run.json`` (a spool left by another run is emptied first)."""
        settings = self.settings
        recipe = {k: settings.resolved[k] for k in ("verifier", "data", "data_gen") if k in settings.resolved}
        run = {
            "recipe": recipe,
            "train_digest": sample_digest(train),
            "num_samples": len(train),
            "heldout_count": heldout_count,
            "max_spool_bytes": int(settings.train.stream.max_spool_gb * 1e9),
            "producer_timeout_s": self.timeout_s,
            "cache_dir": str(self.cache_dir) if settings.train.data_mode == "cache-first-epoch" else None,
        }
        run["run_id"] = hashlib.sha256(json.dumps(run, sort_keys=True).encode()).hexdigest()[:16]
        self.spool.create()
        previous = self.spool.read_json("run.json")
        if previous is not None and previous.get("run_id") != run["run_id"]:
            log.warning("spool %s held another run's items: emptied", self.spool.root)
            for name in self.spool.ready_items():
                self.spool.remove_item(name)
            for path in self.spool.claims.glob("*.json"):
                path.unlink(missing_ok=True)
            (self.spool.root / "plan.json").unlink(missing_ok=True)
        for path in self.spool.cursors.glob("*.json"):  # set again by begin(): until then, held-out only
            path.unlink(missing_ok=True)
        self.spool.finished.unlink(missing_ok=True)
        self.spool.write_json("run.json", run)
        self._layout = {
            "num_aux": len(self.aux_layer_ids),
            "hidden_size": int(self.verifier_config["hidden_size"]),
            "storage_dtype": str(settings.resolved.get("data_gen", {}).get("storage_dtype", "bfloat16")),
        }

    def begin(self, plan: BatchPlan, first_step: int, total_steps: int) -> None:
        """Before the loader starts: rank 0 publishes the plan; every rank points its cursor at ``first_step``'s
        chunk and drops its items before it (consumed before the checkpoint this run resumed from)."""
        stream = self.settings.train.stream
        raw = {
            "num_samples": plan.num_samples,
            "micro_batch_size": plan.micro_batch_size,
            "grad_accum": plan.grad_accum,
            "world_size": plan.world_size,
            "seed": plan.seed,
            "shuffle": plan.shuffle,
            "total_steps": total_steps,
            "chunk_steps": stream.chunk_steps,
            "mode": self.settings.train.data_mode,
        }
        items = ItemPlan(raw)
        self.train_set.plan = items
        if self.rank == 0:
            self._check_budget(items)
            previous = self.spool.read_json("plan.json")
            if previous is not None and previous != raw:  # same samples, other batches: items differ
                for name in self.spool.ready_items():
                    if name != HELDOUT:
                        self.spool.remove_item(name)
            self.spool.write_json("plan.json", raw)
        cursor = items.chunk_of_step(first_step)
        for name in self.spool.ready_items():
            item = items.parse(name)
            if item is not None and item.rank == self.rank and item.chunk < cursor:
                self.spool.remove_item(name)
        self.spool.set_cursor(self.rank, cursor)

    def _check_budget(self, items: ItemPlan) -> None:
        """Refuse a budget that cannot hold the held-out item beside the largest train item (it would deadlock)."""
        budget = int(self.settings.train.stream.max_spool_gb * 1e9)
        largest = max(
            (
                item_bytes_bound(sum(self._lengths[i] for i in idx), len(idx), self._layout)
                for item in items.train_items()
                for idx in [items.indices(item)]
            ),
            default=0,
        )
        heldout = self.heldout_set
        held = 0
        if heldout is not None:
            held = item_bytes_bound(self._heldout_tokens, len(heldout), self._layout)
        if held + largest > budget:
            raise ValueError(
                f"train.stream.max_spool_gb={self.settings.train.stream.max_spool_gb} cannot hold the held-out item "
                f"({held / 1e9:.4f} GB) beside one train item ({largest / 1e9:.4f} GB at "
                f"train.stream.chunk_steps={self.settings.train.stream.chunk_steps}): raise max_spool_gb or lower "
                "chunk_steps"
            )

    def _probe_set(self) -> Dataset:
        """Feature statistics (fc_init, warm start) come from the held-out item: train items stream later."""
        if self.heldout_set is None:
            raise ValueError(
                "streamed training measures model.fc_init / model.warm_start on the held-out samples, and this "
                "recipe has none: set data.heldout_fraction > 0 or model.fc_init=default"
            )
        return self.heldout_set

    def batch(self, item: tuple[MicroBatch, tuple[str, int] | None], weight: float = 1.0) -> MicroBatch:
        packed, ack = item
        batch = packed.to(self.device, dtype=None)
        batch.weight = weight
        if ack is not None:
            self._acknowledge(*ack)
        return batch

    def _acknowledge(self, name: str, chunk: int) -> None:
        """The rank has read an item whole: drop it (or keep epoch 0's in the cache) and move the cursor on."""
        self.spool.set_cursor(
            self.rank, chunk + 1
        )  # first: producers must not take the item for a missing one
        if self.train_set.plan.cache_first_epoch and name.startswith("e0000-"):
            self.spool.move_to_cache(name)
        else:
            self.spool.remove_item(name)

    def target_head(self, target_ids: torch.Tensor) -> TargetHead:
        return TargetHead.from_verifier_files(
            self.settings.verifier.name_or_path, self.verifier_config, target_ids
        )

    def head_probe(self) -> tuple[HeadProbe | None, str]:
        """The probe the first producer records in the spool from its verifier (data_gen.produce); waited for as
        long as a producer is alive, as items are."""
        path = self.spool.root / PROBE_NAME
        started = time.monotonic()
        while not path.is_file():
            waited = time.monotonic() - started
            if waited > self.timeout_s and not self.spool.live_producers(self.timeout_s):
                return None, f"no capture producer recorded {path} within {self.timeout_s:.0f} s"
            time.sleep(0.2)
        return HeadProbe.load(path), str(path)

    def close(self) -> None:
        if self.rank == 0 and self.spool.root.is_dir():
            self.spool.finished.touch()
        if self.pool is not None:
            self.pool.stop()
            self.pool = None


class ProducerPool:
    """``train.stream.local_producers`` capture producers beside the trainer (rank 0), restarted when they die."""

    def __init__(self, spool: Spool, stream: Any, timeout_s: float) -> None:
        self.spool, self.stream, self.timeout_s = spool, stream, timeout_s
        self.logs = spool.root / "logs"
        self.slots: list[tuple[str, subprocess.Popen] | None] = [None] * stream.local_producers
        self.restarts = 0
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, daemon=True)

    def start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        for slot in range(len(self.slots)):
            self._spawn(slot)
        self._monitor.start()

    def _spawn(self, slot: int) -> None:
        name = f"local{slot}-{os.getpid()}-{self.restarts}"
        command = [sys.executable, "-m", "data_gen.produce", "--spool", str(self.spool.root), "--id", name]
        command += ["--device", self.stream.producer_device, "--parent-pid", str(os.getpid())]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
        if self.stream.producer_threads:
            command += ["--threads", str(self.stream.producer_threads)]
            env["OMP_NUM_THREADS"] = str(self.stream.producer_threads)
        self.spool.heartbeat(name, "spawned")  # counts as alive while the interpreter starts
        with (self.logs / f"{name}.log").open("w") as out:
            process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.slots[slot] = (name, process)

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            for slot, entry in enumerate(self.slots):
                if entry is None or entry[1].poll() is None or self._stop.is_set():
                    continue
                name, process = entry
                self.spool.forget_producer(name)  # its claim is re-queued at once
                self.spool.requeue_stale_claims(self.timeout_s)
                if self.restarts >= self.stream.max_restarts:
                    log.error(
                        "capture producer %s exited with code %s and train.stream.max_restarts=%d is spent; log: %s",
                        name,
                        process.returncode,
                        self.stream.max_restarts,
                        self.logs / f"{name}.log",
                    )
                    self.slots[slot] = None
                    continue
                self.restarts += 1
                log.warning(
                    "capture producer %s (pid %d) exited with code %s; restarting it (restart %d of %d); log: %s",
                    name,
                    process.pid,
                    process.returncode,
                    self.restarts,
                    self.stream.max_restarts,
                    self.logs / f"{name}.log",
                )
                print(f"capture producer {name} died (exit {process.returncode}): restarted", flush=True)
                self._spawn(slot)

    def pids(self) -> list[int]:
        return [entry[1].pid for entry in self.slots if entry is not None]

    def stop(self) -> None:
        self._stop.set()
        for entry in self.slots:
            if entry is not None and entry[1].poll() is None:
                entry[1].terminate()
        for entry in self.slots:
            if entry is not None:
                try:
                    entry[1].wait(timeout=30)
                except subprocess.TimeoutExpired:
                    entry[1].kill()
                self.spool.forget_producer(entry[0])


__all__ = ["HeldoutSamples", "ProducerPool", "SpoolSamples", "StreamCollate", "StreamFeatures"]
