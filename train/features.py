"""Where a run's verifier features come from: implementations of one :class:`FeatureSource`, chosen once by
``train.data_mode`` (:func:`train.data_modes.open_features`), so the trainer holds no offline/online/streamed branch.

* :class:`OfflineFeatures`: shards written by data_gen (:class:`data_gen.store.FeatureDataset`), read in their
  storage dtype (bf16/fp8) and packed by the DataLoader workers; the features are finished (dequantised, noised)
  on the device by :meth:`MicroBatch.to`. The target head is read from the verifier's files.
* :class:`OnlineFeatures`: the recipe's conversations, tokenised and masked exactly as data_gen does
  (:class:`TokenDataset`, token ids + loss masks only); the loaded verifier captures the features of each micro
  group on the device (padded, unpacked), which are then packed. The target head is the loaded verifier's own.
* :class:`train.streaming.StreamFeatures` (``stream``, ``cache-first-epoch``): capture producers write the
  features into a bounded spool while the trainer reads them in the plan's order (docs/streaming.md).

Offline features may add a seeded share of another data directory's training split (``train.replay``,
:mod:`train.replay`): the training set is then the primary data followed by the replayed subset, whose size the
batch plan sees; validation and the token counts stay the primary data's.

Each source owns its datasets (``train.max_samples`` applied), the token counts the draft vocabulary is built
from, the collate function its DataLoader workers run (small and picklable: the verifier never crosses into a
worker), how a collated item becomes a device :class:`MicroBatch`, the held-out batches and the target head.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, Subset

from speculators import families
from speculators.head_check import PROBE_NAME, HeadProbe, record_head_probe
from train.data import MicroBatch, eval_groups, pack_documents, truncated_document
from train.settings import LoopSettings, TrainSettings
from train.targets import TargetHead
from train.ttt_attention import resolve_backend


@dataclass(frozen=True)
class RowLayout:
    """How micro batches are packed: rows of ``max_length`` tokens; with compiled flex attention a fixed width
    and a row count rounded up to :func:`train.data.row_buckets` of ``max_rows`` (fixed shapes)."""

    max_length: int
    packing: bool
    noise_std: float = 0.0
    fixed_width: bool = False
    max_rows: int = 0

    @classmethod
    def of(cls, train: LoopSettings, device: torch.device) -> RowLayout:
        fixed = resolve_backend(train.attention_backend, device) == "flex"
        rows = train.micro_batch_size if fixed else 0
        return cls(train.max_length, train.packing, train.noise_std, fixed, rows)

    def pack(
        self, samples: Sequence[dict[str, Any]], feature_dtype: torch.dtype | None = torch.float32
    ) -> MicroBatch:
        return pack_documents(
            samples,
            self.max_length,
            self.packing,
            self.noise_std,
            self.fixed_width,
            self.max_rows,
            feature_dtype,
        )


class FeatureSource:
    """What the trainer needs of its data, whichever the mode. Subclasses set the attributes in ``__init__`` and
    implement :meth:`batch` and :meth:`target_head`."""

    train_set: Dataset
    heldout_set: Dataset | None
    aux_layer_ids: list[int]
    counts: (
        torch.Tensor
    )  # assistant-token counts over the whole training split (the draft vocabulary's input)
    provenance: dict[str, Any]
    collate: Callable[[list[dict[str, Any]]], Any]  # runs in DataLoader workers
    replay: Any = None  # train.replay's :class:`train.replay.ReplayRecord` (offline features only)

    def __init__(self, settings: TrainSettings, accelerator, layout: RowLayout) -> None:
        self.settings, self.layout = settings, layout
        self.device, self.world, self.rank = (
            accelerator.device,
            accelerator.num_processes,
            accelerator.process_index,
        )

    def batch(self, item: Any, weight: float = 1.0) -> MicroBatch:
        """A collated item as a micro batch on the device, features finished."""
        raise NotImplementedError

    def target_head(self, target_ids: torch.Tensor) -> TargetHead:
        raise NotImplementedError

    def head_probe(self) -> tuple[HeadProbe | None, str]:
        """The verifier's own logits on a few real positions (speculators.head_check) and where they come from;
        ``(None, why)`` when this source has none."""
        return None, f"{type(self).__name__} records no head probe"

    def carries_loss_weights(self) -> bool:
        """Whether the training data holds per-token loss weights (``loss_weight``); only offline shards can."""
        return False

    def close(self) -> None:
        """Drop what holds device memory (the online verifier)."""

    def begin(self, plan: Any, first_step: int, total_steps: int) -> None:
        """Called once the run's batch plan and resume step are known, before its loader starts (streamed
        sources publish the plan to their producers; the others need nothing)."""

    def _probe_set(self) -> Dataset:
        """The samples feature statistics are measured on (:meth:`feature_rms`, :meth:`residual_rms`)."""
        return self.train_set

    def _limit(self, max_samples: int | None) -> None:
        """The first N training samples only (data-scaling curves); the token counts still cover the split."""
        if max_samples is not None and max_samples < len(self.train_set):
            self.train_set = Subset(self.train_set, range(max_samples))

    def eval_batches(self) -> Iterator[MicroBatch]:
        """This rank's held-out micro batches (``eval.max_samples`` of them over all ranks, in lockstep)."""
        dataset = self.heldout_set
        limit = self.settings.eval.max_samples
        count = min(len(dataset), limit) if limit else len(dataset)
        for group, weight in eval_groups(count, self.settings.train.micro_batch_size, self.world, self.rank):
            yield self.batch(self.collate([dataset[i] for i in group]), weight)

    @torch.no_grad()
    def _first_states(self, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Aux features ``[N, F]`` and last states ``[N, H]`` at the real positions of the first training samples,
        without noise (the same on every rank). Collated ``micro_batch_size`` samples at a time, as training
        batches are: a fixed-width layout (compiled flex) refuses a batch of more rows than that."""
        probe = self._probe_set()
        count = min(samples, len(probe))
        group = self.settings.train.micro_batch_size
        aux, last = [], []
        for start in range(0, count, group):
            items = [dict(probe[i], noise_seed=0) for i in range(start, min(start + group, count))]
            batch = self.batch(self.collate(items))
            real = batch.document_ids >= 0
            aux.append(batch.aux_hidden[real].float())
            last.append(batch.last_hidden[real].float())
        return torch.cat(aux), torch.cat(last)

    def feature_rms(self, samples: int = 16) -> torch.Tensor:
        """RMS of every aux-feature dimension over the first training samples (``model.fc_init=feature_rms``)."""
        return self._first_states(samples)[0].pow(2).mean(0).sqrt()

    def residual_rms(self, samples: int = 16) -> float:
        """RMS of the verifier's last pre-norm state over the first training samples (``model.warm_start``)."""
        return float(self._first_states(samples)[1].pow(2).mean().sqrt())


class OfflineFeatures(FeatureSource):
    """Features data_gen stored under ``train.data_dir`` (checked against the verifier before training)."""

    def __init__(
        self, settings: TrainSettings, accelerator, layout: RowLayout, verifier_config: dict[str, Any]
    ) -> None:
        from data_gen.store import FeatureDataset, read_token_counts

        super().__init__(settings, accelerator, layout)
        if not settings.train.data_dir:
            raise ValueError(
                "train.data_dir is empty: train.data_mode=offline reads the features data_gen wrote"
            )
        data_dir = Path(settings.train.data_dir)
        self.verifier_config = verifier_config
        # features stay in their storage dtype through the loader; MicroBatch.to converts them on the device
        self.train_set = FeatureDataset(data_dir / "train", dequantize=False)
        heldout = data_dir / "heldout"
        exists = (heldout / "manifest.json").is_file()
        self.heldout_set = FeatureDataset(heldout, dequantize=False) if exists else None
        self.aux_layer_ids = [int(i) for i in self.train_set.manifest["aux_layer_ids"]]
        self._check_manifest(data_dir)
        self.counts, self.provenance = read_token_counts(data_dir)
        self.collate = layout.pack
        self._limit(settings.train.max_samples)
        self._add_replay()

    def _add_replay(self) -> None:
        """``train.replay``: the training set becomes the primary samples followed by the replayed subset (after
        ``max_samples``, so the share is of what is trained on)."""
        from train.replay import with_replay

        replay = self.settings.train.replay
        if not replay.data_dir:
            return
        manifest = self.train_set_manifest()
        self.train_set, self.replay = with_replay(
            self.train_set, Path(replay.data_dir), replay.share, self.settings.seed, manifest
        )
        if self.rank == 0:
            print(self.replay.line(), flush=True)

    def train_set_manifest(self) -> dict[str, Any]:
        """The primary training split's manifest (under a ``max_samples`` subset too)."""
        from train.replay import feature_datasets

        return feature_datasets(self.train_set)[0].manifest

    def carries_loss_weights(self) -> bool:
        from train.replay import carries_loss_weights

        return carries_loss_weights(self.train_set)  # the primary data and any replayed one

    def _check_manifest(self, data_dir: Path) -> None:
        manifest, verifier = self.train_set.manifest, self.settings.verifier
        wanted, config = verifier.aux_layer_ids, self.verifier_config
        if wanted is not None and list(wanted) != self.aux_layer_ids:
            raise ValueError(
                f"verifier.aux_layer_ids={list(wanted)} but the features in {data_dir} hold layers "
                f"{self.aux_layer_ids}; regenerate the data or drop the override"
            )
        if int(manifest["vocab_size"]) != int(config["vocab_size"]):
            raise ValueError(
                f"{data_dir} was made with a {manifest['vocab_size']}-token verifier, but "
                f"{verifier.name_or_path} has {config['vocab_size']}; point verifier.name_or_path at the data's "
                "verifier"
            )
        if int(manifest["hidden_size"]) != int(config["hidden_size"]):
            raise ValueError(
                f"{data_dir} holds features of hidden size {manifest['hidden_size']}, but "
                f"{verifier.name_or_path} has {config['hidden_size']}; use the data's verifier"
            )

    def batch(self, item: MicroBatch, weight: float = 1.0) -> MicroBatch:
        batch = item.to(self.device, dtype=None)
        batch.weight = weight
        return batch

    def target_head(self, target_ids: torch.Tensor) -> TargetHead:
        return TargetHead.from_verifier_files(
            self.settings.verifier.name_or_path, self.verifier_config, target_ids
        )

    def head_probe(self) -> tuple[HeadProbe | None, str]:
        path = Path(self.settings.train.data_dir) / PROBE_NAME
        probe = HeadProbe.load(path)
        if probe is None:
            return (
                None,
                f"{path} is missing (data generated before head probes): rerun data_gen to check the head",
            )
        return probe, str(path)


class OnlineFeatures(FeatureSource):
    """Verifier in the loop: it captures the features of every token-only micro group, which are then packed."""

    def __init__(
        self, settings: TrainSettings, accelerator, layout: RowLayout, verifier_config: dict[str, Any]
    ) -> None:
        from data_gen.capture import FeatureCapture
        from data_gen.pipeline import encode_recipe_conversations
        from speculators.verifier import load_verifier
        from train.assemble import outside_zero3_init

        super().__init__(settings, accelerator, layout)
        verifier = settings.verifier
        with outside_zero3_init(accelerator):  # frozen: whole weights, not ZeRO-3 partitions
            self.verifier, tokenizer = load_verifier(verifier.name_or_path, verifier.dtype, self.device)
        wanted = list(verifier.aux_layer_ids) if verifier.aux_layer_ids is not None else None
        self.capture = FeatureCapture(self.verifier, wanted, out_dtype=None)
        self.aux_layer_ids = self.capture.aux_layer_ids
        chat = families.of_model(self.verifier).chat
        train_samples, heldout_samples = encode_recipe_conversations(
            settings.data, tokenizer, chat, verifier=settings.verifier.name_or_path
        )
        self.train_set = TokenDataset(train_samples)
        self.heldout_set = TokenDataset(heldout_samples) if heldout_samples else None
        self.counts = self.train_set.token_counts(int(verifier_config["vocab_size"]))
        self.provenance = {"source": "online"}
        self.collate = identity_collate
        self._limit(settings.train.max_samples)

    def batch(self, item: list[dict[str, Any]], weight: float = 1.0) -> MicroBatch:
        device = self.capture.device
        docs = [truncated_document(s, self.layout.max_length) for s in item]
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
        batch = self.layout.pack(docs, None).to(
            device
        )  # features stay in the verifier's dtype; noise added here
        batch.weight = weight
        return batch

    def target_head(self, target_ids: torch.Tensor) -> TargetHead:
        return TargetHead.from_model(self.verifier, target_ids)

    def head_probe(self) -> tuple[HeadProbe | None, str]:
        ids = self.train_set[0]["input_ids"]
        return record_head_probe(self.verifier, ids), "the online verifier's forward on the first sample"

    def close(self) -> None:
        self.__dict__.pop("capture", None)
        self.__dict__.pop("verifier", None)


# ---- online samples -----------------------------------------------------------------------------------------
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


def identity_collate(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Online collate: the token-only samples as they are (the verifier packs them on the device)."""
    return samples


__all__ = [
    "FeatureSource",
    "OfflineFeatures",
    "OnlineFeatures",
    "RowLayout",
    "TokenDataset",
    "identity_collate",
]
