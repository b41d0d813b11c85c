"""Batches for the trainer: a deterministic global-batch plan, packing with document ids, offline and online
features.

* :class:`BatchPlan` decides which samples every optimizer step uses from ``(seed, epoch, step)`` alone: the epoch
  permutation is split into global batches of ``micro_batch_size × grad_accum × world_size`` samples, and micro
  group ``c`` of a global batch goes to rank ``c % world`` at accumulation index ``c // world``. The data position
  is therefore just the step number (exact resume), and 1 process with micro batch 4 sees the same global batch as
  2 processes with micro batch 2.
* :func:`pack_documents` turns a micro group into one :class:`MicroBatch`: documents (truncated to ``max_length``)
  are packed first-fit into rows of at most ``max_length`` tokens (``packing=true``) or one per row, padded to the
  longest row. ``document_ids`` (−1 on padding) keep attention and targets inside each document; position ids
  restart at 0 in every document.
* Feature noise (``train.noise_std``) is drawn per training document from ``(seed, epoch, sample index)``: the same
  on any number of processes and after any resume, without relying on RNG state.
* Offline: samples come from :class:`data_gen.store.FeatureDataset` with their features. Online: from
  :class:`TokenDataset` (token ids + loss masks only); :class:`OnlineFeatures` runs the verifier's
  :class:`data_gen.capture.FeatureCapture` on the micro group (padded, unpacked) and then packs the result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset


# ---- the micro batch ----------------------------------------------------------------------------------------
@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # long [B, L]
    loss_mask: torch.Tensor  # bool [B, L]
    document_ids: torch.Tensor  # long [B, L], -1 on padding
    position_ids: torch.Tensor  # long [B, L], restarting in each document
    aux_hidden: torch.Tensor | None  # [B, L, n*H]
    last_hidden: torch.Tensor | None  # [B, L, H]
    num_documents: int
    weight: float = 1.0  # 0 for the filler batches that keep ranks in lockstep during evaluation

    @property
    def num_tokens(self) -> int:
        return int((self.document_ids >= 0).sum())

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> MicroBatch:
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value.to(device, non_blocking=True)
                if dtype is not None and value.is_floating_point():
                    value = value.to(dtype)
            moved[f.name] = value
        return MicroBatch(**moved)


def _document(sample: dict[str, Any], max_length: int) -> dict[str, Any]:
    keep = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")
    doc = {k: sample[k][:max_length] for k in keep if sample.get(k) is not None}
    if "noise_seed" in sample:
        doc["noise_seed"] = sample["noise_seed"]
    return doc


def noise_seed(seed: int, epoch: int, index: int) -> int:
    """The noise of sample ``index`` in ``epoch``: a function of the data alone, not of ranks or RNG state."""
    return (int(seed) * 1_000_003 + int(epoch)) * 10_000_019 + int(index)


def add_feature_noise(doc: dict[str, Any], std: float) -> None:
    """Gaussian noise (std ``std``) on the verifier features of one training document, from its own seed."""
    if std <= 0 or "noise_seed" not in doc or doc.get("aux_hidden") is None:
        return
    aux = doc["aux_hidden"]
    gen = torch.Generator(device=aux.device).manual_seed(doc["noise_seed"] % (2**63))
    noise = torch.randn(aux.shape, generator=gen, device=aux.device, dtype=torch.float32)
    doc["aux_hidden"] = aux + (noise * std).to(aux.dtype)


def assign_rows(lengths: Sequence[int], max_length: int, packing: bool) -> list[list[int]]:
    """Document indices per row: first-fit in the given order (packing) or one document per row."""
    if not packing:
        return [[i] for i in range(len(lengths))]
    rows: list[list[int]] = []
    free: list[int] = []
    for index, length in enumerate(lengths):
        for row, space in enumerate(free):
            if length <= space:
                rows[row].append(index)
                free[row] -= length
                break
        else:
            rows.append([index])
            free.append(max_length - length)
    return rows


def pack_documents(
    samples: Sequence[dict[str, Any]],
    max_length: int,
    packing: bool,
    noise_std: float = 0.0,
    fixed_width: bool = False,
) -> MicroBatch:
    """Pack (or pad) samples into one micro batch; features are copied when present (plus training noise).

    Rows are as wide as the longest one, or exactly ``max_length`` with ``fixed_width`` (compiled flex attention
    on GPUs would otherwise recompile for every new width).
    """
    docs = [_document(s, max_length) for s in samples]
    for doc in docs:
        add_feature_noise(doc, noise_std)
    lengths = [int(d["input_ids"].shape[0]) for d in docs]
    rows = assign_rows(lengths, max_length, packing)
    width = max_length if fixed_width else max(sum(lengths[i] for i in row) for row in rows)
    first = docs[0]
    device = first["input_ids"].device
    shape = (len(rows), width)
    batch = {
        "input_ids": torch.zeros(shape, dtype=torch.long, device=device),
        "loss_mask": torch.zeros(shape, dtype=torch.bool, device=device),
        "document_ids": torch.full(shape, -1, dtype=torch.long, device=device),
        "position_ids": torch.zeros(shape, dtype=torch.long, device=device),
    }
    for name in ("aux_hidden", "last_hidden"):
        if name in first:
            batch[name] = torch.zeros((*shape, first[name].shape[-1]), dtype=first[name].dtype, device=device)
    for r, row in enumerate(rows):
        start = 0
        for doc_number, index in enumerate(row):
            doc, stop = docs[index], start + lengths[index]
            batch["input_ids"][r, start:stop] = doc["input_ids"]
            batch["loss_mask"][r, start:stop] = doc["loss_mask"].bool()
            batch["document_ids"][r, start:stop] = doc_number
            batch["position_ids"][r, start:stop] = torch.arange(lengths[index], device=device)
            for name in ("aux_hidden", "last_hidden"):
                if name in batch:
                    batch[name][r, start:stop] = doc[name]
            start = stop
    return MicroBatch(
        aux_hidden=batch.pop("aux_hidden", None),
        last_hidden=batch.pop("last_hidden", None),
        num_documents=len(docs),
        **batch,
    )


# ---- the plan -----------------------------------------------------------------------------------------------
@dataclass
class BatchPlan:
    num_samples: int
    micro_batch_size: int
    grad_accum: int
    world_size: int
    seed: int
    shuffle: bool = True

    def __post_init__(self) -> None:
        self._orders: dict[int, torch.Tensor] = {}
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"{self.num_samples} training samples cannot fill one global batch of {self.global_batch} "
                f"(micro_batch_size {self.micro_batch_size} × grad_accum {self.grad_accum} × "
                f"{self.world_size} processes); lower train.micro_batch_size / train.grad_accum or add data"
            )

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch  # the incomplete last global batch is dropped

    def order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._orders = {epoch: torch.randperm(self.num_samples, generator=gen)}
            else:
                self._orders = {epoch: torch.arange(self.num_samples)}
        return self._orders[epoch]

    def micro_indices(self, epoch: int, step: int, accum: int, rank: int) -> list[int]:
        """Sample indices of one micro group (rank ``rank``, accumulation index ``accum``)."""
        group = accum * self.world_size + rank
        start = step * self.global_batch + group * self.micro_batch_size
        return self.order(epoch)[start : start + self.micro_batch_size].tolist()


class MicroBatchStream(Dataset):
    """The micro batches one rank consumes for optimizer steps ``[first_step, last_step)``, in order, across
    epochs (``batch_size=None``). One loader for the whole run keeps DataLoader workers (and what they cached,
    such as verified shards) alive between epochs."""

    def __init__(
        self, source: Dataset, plan: BatchPlan, rank: int, first_step: int, last_step: int, collate
    ) -> None:
        self.source, self.plan, self.rank, self.collate = source, plan, rank, collate
        self.first_step, self.last_step = first_step, last_step

    def __len__(self) -> int:
        return max(0, self.last_step - self.first_step) * self.plan.grad_accum

    def __getitem__(self, item: int):
        step = self.first_step + item // self.plan.grad_accum
        epoch, step_in_epoch = divmod(step, self.plan.steps_per_epoch)
        indices = self.plan.micro_indices(epoch, step_in_epoch, item % self.plan.grad_accum, self.rank)
        samples = [dict(self.source[i], noise_seed=noise_seed(self.plan.seed, epoch, i)) for i in indices]
        return self.collate(samples)


def run_loader(
    source: Dataset,
    plan: BatchPlan,
    rank: int,
    first_step: int,
    last_step: int,
    collate,
    num_workers: int = 0,
) -> DataLoader:
    stream = MicroBatchStream(source, plan, rank, first_step, last_step, collate)
    return DataLoader(
        stream, batch_size=None, shuffle=False, num_workers=num_workers, persistent_workers=num_workers > 0
    )


def eval_groups(
    num_samples: int, micro_batch_size: int, world_size: int, rank: int
) -> list[tuple[list[int], float]]:
    """Held-out micro groups of this rank, round robin; every rank gets the same count (ZeRO-3 gathers are
    collective), shorter ranks repeat a group with weight 0."""
    groups = [
        list(range(start, min(start + micro_batch_size, num_samples)))
        for start in range(0, num_samples, micro_batch_size)
    ]
    per_rank = math.ceil(len(groups) / world_size) if groups else 0
    mine = [(g, 1.0) for g in groups[rank::world_size]]
    while len(mine) < per_rank:
        mine.append((groups[0], 0.0))
    return mine


# ---- offline / online sources -------------------------------------------------------------------------------
class TokenDataset(Dataset):
    """Tokenised samples for online training: ``{"sample_id", "input_ids", "loss_mask"}`` (no features)."""

    def __init__(self, samples: Sequence[Any]) -> None:
        self.samples = list(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item: int) -> dict[str, Any]:
        sample = self.samples[item]
        return {
            "sample_id": sample.sample_id,
            "input_ids": torch.tensor(sample.input_ids, dtype=torch.long),
            "loss_mask": torch.tensor(sample.loss_mask, dtype=torch.bool),
        }

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """Assistant-token counts (loss_mask == 1), the input of the draft vocabulary."""
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for sample in self.samples:
            ids = torch.tensor(sample.input_ids, dtype=torch.long)[
                torch.tensor(sample.loss_mask, dtype=torch.bool)
            ]
            counts += torch.bincount(ids, minlength=vocab_size)
        return counts


class OnlineFeatures:
    """Verifier in the loop: captures features for a token-only micro group, then packs it."""

    def __init__(
        self, capture: Any, max_length: int, packing: bool, noise_std: float = 0.0, fixed_width: bool = False
    ) -> None:
        self.capture, self.max_length, self.packing, self.noise_std = capture, max_length, packing, noise_std
        self.fixed_width = fixed_width

    def __call__(self, samples: list[dict[str, Any]], weight: float = 1.0) -> MicroBatch:
        device = self.capture.device
        docs = [_document(s, self.max_length) for s in samples]
        width = max(int(d["input_ids"].shape[0]) for d in docs)
        ids = torch.zeros(len(docs), width, dtype=torch.long)
        attention = torch.zeros(len(docs), width, dtype=torch.long)
        for i, doc in enumerate(docs):
            ids[i, : len(doc["input_ids"])] = doc["input_ids"]
            attention[i, : len(doc["input_ids"])] = 1
        features = self.capture.capture(ids.to(device), attention.to(device))
        for i, doc in enumerate(docs):
            n = int(doc["input_ids"].shape[0])
            doc["input_ids"] = doc["input_ids"].to(device)
            doc["loss_mask"] = doc["loss_mask"].to(device)
            doc["aux_hidden"] = features["aux_hidden"][i, :n]
            doc["last_hidden"] = features["last_hidden"][i, :n]
        batch = pack_documents(docs, self.max_length, self.packing, self.noise_std, self.fixed_width)
        batch.weight = weight
        return batch


def encode_conversations(data_cfg: Any, tokenizer: Any) -> tuple[list[Any], list[Any]]:
    """Online mode: the recipe's conversations, split and masked exactly as data_gen does (no regeneration)."""
    from omegaconf import OmegaConf

    from data_gen.masks import ChatMasker
    from data_gen.pipeline import encode_conversations as encode
    from data_gen.sources import DataSettings, load_conversations, split_conversations

    mapping = OmegaConf.to_container(data_cfg, resolve=True) if not isinstance(data_cfg, dict) else data_cfg
    settings = DataSettings.from_mapping(mapping)
    conversations, _ = load_conversations(settings)
    train, heldout = split_conversations(conversations, settings.heldout_fraction, settings.seed)
    masker = ChatMasker(tokenizer, settings.turn_mode, settings.chat_template)
    return encode(masker, train, settings)[0], encode(masker, heldout, settings)[0]


def identity_collate(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return samples


__all__ = [
    "BatchPlan",
    "MicroBatch",
    "OnlineFeatures",
    "TokenDataset",
    "assign_rows",
    "encode_conversations",
    "run_loader",
    "eval_groups",
    "identity_collate",
    "pack_documents",
]
