"""``train.replay``: mixing a share of the original training data into an adapted draft's run (issue 41).

A draft adapted to served traffic trains on a small traffic dataset, warm-started from the serving draft. Trained on
that alone it forgets what the original data taught it, so a deterministic subset of the original data's TRAIN
split (a data_gen output of the same verifier and aux layers) is added: ``share`` of the training samples, that is
``share · n_primary / (1 - share)`` replayed samples, capped at what the replay directory holds (said in one line).
The subset is drawn from ``seed`` alone, so every process and every resume train on the same samples.

What stays the primary data's: the held-out split (the run is judged on the traffic it adapts to), the token
counts the draft vocabulary is built from, and the head probe. The replayed features must be read exactly as the
primary ones (same aux layers, hidden size, vocabulary, storage dtype, verifier and tokenizer), else the run is
refused naming the directory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import ConcatDataset, Dataset, Subset

# manifest keys both datasets must agree on: the features are packed into the same batches and read by one fc
MATCHING_KEYS = ("aux_layer_ids", "hidden_size", "vocab_size", "storage_dtype")
# fingerprints compared when both manifests record them (older data and test fixtures may not)
FINGERPRINTS = ("verifier", "tokenizer")


@dataclass(frozen=True)
class ReplayRecord:
    """What ``train.replay`` added to a run (written to the run's data-sources record)."""

    data_dir: str
    share: float
    primary_samples: int
    replay_samples: int  # the replayed samples trained on
    available: int  # the replay directory's training samples
    capped: bool  # fewer than the share asked for: the directory holds no more

    def line(self) -> str:
        total = self.primary_samples + self.replay_samples
        capped = f" (capped: {self.data_dir}/train holds only {self.available})" if self.capped else ""
        return (
            f"train.replay: {self.replay_samples} samples of {self.data_dir}/train mixed with the "
            f"{self.primary_samples} of train.data_dir ({self.replay_samples / max(total, 1):.1%} of {total}, "
            f"train.replay.share={self.share}){capped}"
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def replay_count(primary: int, share: float, available: int) -> tuple[int, bool]:
    """``(samples to replay, capped)``: ``share`` of the mixed set, at most ``available``."""
    wanted = round(share * primary / (1.0 - share)) if share > 0 else 0
    return min(wanted, available), wanted > available


def replay_indices(available: int, count: int, seed: int) -> list[int]:
    """``count`` distinct sample indices of ``available``, drawn from ``seed`` alone, ascending (shard order)."""
    generator = torch.Generator().manual_seed(int(seed))
    return sorted(torch.randperm(available, generator=generator)[:count].tolist())


def open_replay(replay_dir: Path, primary_manifest: dict[str, Any]) -> Dataset:
    """The replay directory's training split, refused in one line when missing or unlike the primary data."""
    from data_gen.store import MANIFEST_NAME, FeatureDataset

    manifest = replay_dir / "train" / MANIFEST_NAME
    if not manifest.is_file():
        raise FileNotFoundError(
            f"train.replay.data_dir={replay_dir}: {manifest} is missing; point it at a data_gen output directory"
        )
    dataset = FeatureDataset(replay_dir / "train", dequantize=False)
    problem = manifest_mismatch(dataset.manifest, primary_manifest)
    if problem:
        raise ValueError(
            f"train.replay.data_dir={replay_dir}: its features differ from train.data_dir's ({problem}); replay "
            "data captured with the same verifier, aux layers and storage dtype"
        )
    return dataset


def manifest_mismatch(replay: dict[str, Any], primary: dict[str, Any]) -> str | None:
    """The first difference that makes the replayed features unreadable beside the primary ones, or None."""
    for key in MATCHING_KEYS:
        if replay.get(key) != primary.get(key):
            return f"{key} {replay.get(key)} vs {primary.get(key)}"
    for key in FINGERPRINTS:
        theirs = (replay.get(key) or {}).get("fingerprint")
        ours = (primary.get(key) or {}).get("fingerprint")
        if theirs and ours and theirs != ours:
            return f"{key} fingerprint {theirs[:12]}… vs {ours[:12]}…"
    return None


def with_replay(
    primary: Dataset, replay_dir: Path, share: float, seed: int, primary_manifest: dict[str, Any]
) -> tuple[Dataset, ReplayRecord]:
    """The training set ``primary`` followed by its replayed subset, and what was added."""
    replay = open_replay(replay_dir, primary_manifest)
    count, capped = replay_count(len(primary), share, len(replay))
    chosen = Subset(replay, replay_indices(len(replay), count, seed))
    record = ReplayRecord(str(replay_dir), share, len(primary), count, len(replay), capped)
    return ConcatDataset([primary, chosen]), record


def carries_loss_weights(dataset: Dataset) -> bool:
    """Whether the training data holds per-token loss weights (``loss_weight``, data_gen/store.py). A shard holds
    the tensor when any of its samples has weights, so every shard's header is read (no data, no hashing): a data
    directory may have them in some shards only. A dataset that is not shards is asked for its first sample."""
    return any(_holds_weights(part) for part in feature_datasets(dataset))


def feature_datasets(dataset: Dataset) -> list[Dataset]:
    """The datasets under ``max_samples`` subsets and the replay concatenation."""
    if isinstance(dataset, Subset):
        return feature_datasets(dataset.dataset)
    if isinstance(dataset, ConcatDataset):
        return [inner for part in dataset.datasets for inner in feature_datasets(part)]
    return [dataset]


def _holds_weights(dataset: Dataset) -> bool:
    from safetensors import safe_open

    manifest = getattr(dataset, "manifest", None)
    if manifest is None:
        return len(dataset) > 0 and dataset[0].get("loss_weight") is not None
    for record in manifest["shards"]:
        with safe_open(str(Path(dataset.split_dir) / record["file"]), framework="pt") as handle:
            if "loss_weight" in handle.keys():
                return True
    return False


__all__ = [
    "ReplayRecord",
    "carries_loss_weights",
    "feature_datasets",
    "manifest_mismatch",
    "open_replay",
    "replay_count",
    "replay_indices",
    "with_replay",
]
