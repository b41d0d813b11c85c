"""Batches for the trainer: a deterministic global-batch plan and packing with document ids.

* :class:`data_gen.batch_plan.BatchPlan` decides which samples every optimizer step uses from ``(seed, epoch,
  step)`` alone (the data position is just the step number: exact resume); :class:`MicroBatchStream` follows it.
* :func:`pack_documents` turns a micro group into one :class:`MicroBatch`: documents (truncated to ``max_length``)
  are packed first-fit into rows of at most ``max_length`` tokens (``packing=true``) or one per row, padded to the
  longest row. ``document_ids`` (−1 on padding) keep attention and targets inside each document; position ids
  restart at 0 in every document.
  With compiled flex attention the shape is fixed: width ``max_length``, rows rounded up to :func:`row_buckets`.
* Feature noise (``train.noise_std``) is drawn per training document from ``(seed, epoch, sample index)``: the same
  on any number of processes and after any resume, without relying on RNG state. It is added on the device, in
  :meth:`MicroBatch.to`, together with the conversion of the features from their storage dtype.
* Where the samples and their features come from (offline shards or the verifier online) is
  :mod:`train.features`.
* Per-token loss weights (``loss_weight``, float [T] per sample: >1 where the serving draft was rejected, mean 1
  over the sample's loss tokens, 0 elsewhere) travel as :attr:`MicroBatch.loss_weight`; a document without them
  in a batch where others have them weighs its loss tokens 1.0 (its loss mask as floats).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset

from data_gen.batch_plan import BatchPlan

# ---- the micro batch ----------------------------------------------------------------------------------------
FEATURES = ("aux_hidden", "last_hidden")


@dataclass
class MicroBatch:
    """One micro batch. Features may travel in their storage dtype (bf16, or fp8 with ``*_scale``) with their
    noise still pending: :meth:`to` finishes them on the target device, so DataLoader workers pass half (bf16) or a
    quarter (fp8) of the fp32 bytes through shared memory and the device does the conversion and the noise."""

    input_ids: torch.Tensor  # long [B, L]
    loss_mask: torch.Tensor  # bool [B, L]
    document_ids: torch.Tensor  # long [B, L], -1 on padding
    position_ids: torch.Tensor  # long [B, L], restarting in each document
    aux_hidden: torch.Tensor | None  # [B, L, n*H]
    last_hidden: torch.Tensor | None  # [B, L, H]
    num_documents: int
    weight: float = 1.0  # 0 for the filler batches that keep ranks in lockstep during evaluation
    aux_scale: torch.Tensor | None = None  # fp32 [B, L, n] for fp8 storage (dequantised by ``to``)
    last_scale: torch.Tensor | None = None  # fp32 [B, L, 1]
    feature_dtype: torch.dtype | None = None  # what ``to`` converts the features to (None: keep)
    noise: tuple[tuple[int, int, int, int], ...] = ()  # pending (row, start, stop, seed) per noised document
    noise_std: float = 0.0
    loss_weight: torch.Tensor | None = None  # float [B, L] per-token loss weights (None: the data has none)

    @property
    def num_tokens(self) -> int:
        return int((self.document_ids >= 0).sum())

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> MicroBatch:
        """Move to ``device``, then dequantise/convert the features and add their pending noise there."""
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value.to(device, non_blocking=True)
            moved[f.name] = value
        batch = MicroBatch(**moved)
        batch._finish_features()
        if dtype is not None:
            for name in FEATURES:
                value = getattr(batch, name)
                if value is not None and value.is_floating_point():
                    setattr(batch, name, value.to(dtype))
        return batch

    def _finish_features(self) -> None:
        from data_gen.store import dequantize

        for name, scale_name in zip(FEATURES, ("aux_scale", "last_scale"), strict=True):
            value, scale = getattr(self, name), getattr(self, scale_name)
            if value is None:
                continue
            if scale is not None:
                flat = dequantize(value.reshape(-1, value.shape[-1]), scale.reshape(-1, scale.shape[-1]))
                value = flat.reshape(value.shape)
            elif self.feature_dtype is not None:
                value = value.to(self.feature_dtype)
            setattr(self, name, value)
            setattr(self, scale_name, None)
        self.feature_dtype = None
        if self.noise and self.aux_hidden is not None:
            self.aux_hidden = self.aux_hidden + feature_noise(self.aux_hidden, self.noise, self.noise_std)
        self.noise = ()


# ---- which positions carry the training loss ----------------------------------------------------------------
def training_loss_mask(batch: MicroBatch, loss_positions: str) -> torch.Tensor:
    """Positions whose token is a training target: the stored loss mask (assistant tokens) or, with ``all``, every
    real token of every document (user turns and template tokens too, never padding).

    Capturing a token's features costs as much as training on it, and the verifier's distribution at a user token
    is as valid a target as at an assistant token, so ``all`` trains on the whole captured conversation. Only the
    training step uses this: validation and the simulated acceptance keep the stored mask (assistant text, what a
    draft is served on), so their numbers stay comparable across settings."""
    if loss_positions == "all":
        return batch.document_ids >= 0
    if loss_positions == "assistant":
        return batch.loss_mask
    raise ValueError(f"train.loss_positions={loss_positions!r}: use assistant or all")


def training_loss_weight(batch: MicroBatch) -> torch.Tensor | None:
    """The per-token loss weights of a training step (None: the data has none): the data's on the stored loss
    mask and 1.0 elsewhere. The data defines weights on assistant tokens only (where the serving draft drafted);
    ``train.loss_positions=all`` also trains user and template tokens, which then count as an unweighted run
    counts them, rather than not at all."""
    if batch.loss_weight is None:
        return None
    return torch.where(batch.loss_mask.bool(), batch.loss_weight.float(), 1.0)


def truncated_document(sample: dict[str, Any], max_length: int) -> dict[str, Any]:
    keep = ("input_ids", "loss_mask", "loss_weight", "aux_hidden", "last_hidden", "aux_scale", "last_scale")
    doc = {k: sample[k][:max_length] for k in keep if sample.get(k) is not None}
    if "noise_seed" in sample:
        doc["noise_seed"] = sample["noise_seed"]
    return doc


def noise_seed(seed: int, epoch: int, index: int) -> int:
    """The noise of sample ``index`` in ``epoch``: a function of the data alone, not of ranks or RNG state."""
    return (int(seed) * 1_000_003 + int(epoch)) * 10_000_019 + int(index)


def feature_noise(
    aux: torch.Tensor, placements: Sequence[tuple[int, int, int, int]], std: float
) -> torch.Tensor:
    """Gaussian noise (std ``std``) for the verifier features of each training document, drawn on ``aux``'s device
    from the document's own seed (``placements``: row, start, stop, seed); zero on padding."""
    delta = torch.zeros_like(aux)
    for row, start, stop, seed in placements:
        gen = torch.Generator(device=aux.device).manual_seed(seed % (2**63))
        noise = torch.randn(
            (stop - start, aux.shape[-1]), generator=gen, device=aux.device, dtype=torch.float32
        )
        delta[row, start:stop] = (noise * std).to(aux.dtype)
    return delta


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


def row_buckets(micro_batch_size: int) -> list[int]:
    """The row counts a fixed-shape micro batch is padded to: powers of two below the micro batch size, and it.

    Compiled flex attention compiles once per shape; padding every micro batch to the full size would cost compute
    when packing fills fewer rows, so the row count is rounded up to one of these (log2 + 1 shapes)."""
    if micro_batch_size < 1:
        raise ValueError(f"train.micro_batch_size={micro_batch_size}: needs at least one sample")
    powers = [1 << i for i in range(micro_batch_size.bit_length()) if 1 << i < micro_batch_size]
    return [*powers, micro_batch_size]


def padded_row_count(rows: int, max_rows: int) -> int:
    """The smallest of :func:`row_buckets` ``(max_rows)`` that holds ``rows``."""
    for bucket in row_buckets(max_rows):
        if bucket >= rows:
            return bucket
    raise ValueError(f"a micro batch of {rows} rows is larger than train.micro_batch_size={max_rows}")


def pack_documents(
    samples: Sequence[dict[str, Any]],
    max_length: int,
    packing: bool,
    noise_std: float = 0.0,
    fixed_width: bool = False,
    max_rows: int = 0,
    feature_dtype: torch.dtype | None = torch.float32,
) -> MicroBatch:
    """Pack (or pad) samples into one micro batch; features are copied in the dtype they come in.

    Rows are as wide as the longest one, or exactly ``max_length`` with ``fixed_width``, and their count is
    rounded up to a :func:`row_buckets` size of ``max_rows`` when it is set (compiled flex attention on GPUs would
    otherwise recompile for every new shape). Feature noise (``noise_std``) and the conversion to
    ``feature_dtype`` happen in :meth:`MicroBatch.to`, on the device.
    """
    docs = [truncated_document(s, max_length) for s in samples]
    lengths = [int(d["input_ids"].shape[0]) for d in docs]
    rows = assign_rows(lengths, max_length, packing)
    width = max_length if fixed_width else max(sum(lengths[i] for i in row) for row in rows)
    first = docs[0]
    device = first["input_ids"].device
    shape = (padded_row_count(len(rows), max_rows) if max_rows else len(rows), width)
    batch = {
        "input_ids": torch.zeros(shape, dtype=torch.long, device=device),
        "loss_mask": torch.zeros(shape, dtype=torch.bool, device=device),
        "document_ids": torch.full(shape, -1, dtype=torch.long, device=device),
        "position_ids": torch.zeros(shape, dtype=torch.long, device=device),
    }
    tensors = [name for name in (*FEATURES, "aux_scale", "last_scale") if first.get(name) is not None]
    for name in tensors:
        batch[name] = torch.zeros((*shape, first[name].shape[-1]), dtype=first[name].dtype, device=device)
    weighted = any(doc.get("loss_weight") is not None for doc in docs)
    if weighted:
        batch["loss_weight"] = torch.zeros(shape, dtype=torch.float32, device=device)
    noise = []
    for r, row in enumerate(rows):
        start = 0
        for doc_number, index in enumerate(row):
            doc, stop = docs[index], start + lengths[index]
            batch["input_ids"][r, start:stop] = doc["input_ids"]
            batch["loss_mask"][r, start:stop] = doc["loss_mask"].bool()
            batch["document_ids"][r, start:stop] = doc_number
            batch["position_ids"][r, start:stop] = torch.arange(lengths[index], device=device)
            for name in tensors:
                batch[name][r, start:stop] = doc[name]
            if weighted:
                batch["loss_weight"][r, start:stop] = document_loss_weight(doc)
            if noise_std > 0 and "noise_seed" in doc and "aux_hidden" in batch:
                noise.append((r, start, stop, int(doc["noise_seed"])))
            start = stop
    return MicroBatch(
        aux_hidden=batch.pop("aux_hidden", None),
        last_hidden=batch.pop("last_hidden", None),
        aux_scale=batch.pop("aux_scale", None),
        last_scale=batch.pop("last_scale", None),
        loss_weight=batch.pop("loss_weight", None),
        num_documents=len(docs),
        feature_dtype=feature_dtype,
        noise=tuple(noise),
        noise_std=float(noise_std),
        **batch,
    )


def document_loss_weight(doc: dict[str, Any]) -> torch.Tensor:
    """A document's per-token loss weights; one without (replayed data) weighs its loss tokens 1.0."""
    weight = doc.get("loss_weight")
    return doc["loss_mask"].float() if weight is None else weight.float()


# ---- following the plan (data_gen.batch_plan.BatchPlan) -----------------------------------------------------
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
        samples = read_samples(self.source, epoch, indices)
        seeds = [noise_seed(self.plan.seed, epoch, i) for i in indices]
        return self.collate(
            [dict(sample, noise_seed=seed) for sample, seed in zip(samples, seeds, strict=True)]
        )


def read_samples(source: Dataset, epoch: int, indices: list[int]) -> list[dict[str, Any]]:
    """The samples ``indices`` of ``epoch``: by index from a dataset, or through its ``epoch_samples`` when its
    features depend on the epoch (streamed features are captured per epoch, train.streaming.SpoolSamples)."""
    by_epoch = getattr(source, "epoch_samples", None)
    return by_epoch(epoch, indices) if by_epoch is not None else [source[i] for i in indices]


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
    if num_workers > 0:
        verify_before_workers(source)
    return DataLoader(
        stream, batch_size=None, shuffle=False, num_workers=num_workers, persistent_workers=num_workers > 0
    )


def verify_before_workers(source: Dataset, items: list[int] | None = None) -> None:
    """Hash the shards ``source`` reads (``items``: only those samples) in this process, before DataLoader workers
    copy it: every worker would otherwise re-hash every shard it opens (a feature dataset's ``verify_shards``;
    others have nothing to check). Subsets and concatenations (``max_samples``, ``train.replay``) are followed
    down to their feature datasets."""
    if isinstance(source, Subset):
        inner = list(source.indices)
        verify_before_workers(source.dataset, inner if items is None else [inner[i] for i in items])
        return
    if isinstance(source, ConcatDataset):
        bounds = [0, *source.cumulative_sizes]
        for part, low, high in zip(source.datasets, bounds, bounds[1:], strict=False):
            mine = None if items is None else [i - low for i in items if low <= i < high]
            verify_before_workers(part, mine)
        return
    verify = getattr(source, "verify_shards", None)
    if verify is not None:
        verify(items)


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


__all__ = [
    "MicroBatch",
    "assign_rows",
    "run_loader",
    "eval_groups",
    "pack_documents",
    "row_buckets",
    "training_loss_mask",
    "training_loss_weight",
]
