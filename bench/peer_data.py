"""The peer lane's data: a data_gen output directory converted into ``speculators==0.9.0``'s data layout
(:mod:`bench.peer_lane` runs the lane).

The peer's data layout (its ``train/data.py`` ArrowDataset and ``hs_connectors`` FileTransfer):
  * an Arrow dataset (``datasets.save_to_disk``, torch format) with ``input_ids``, ``loss_mask`` (int64, its own
    preprocessing's dtype) and ``seq_len`` per sample; the first ``int(n * train_data_ratio)`` rows train, the rest
    validate. We write train samples then held-out samples and pick the ratio so the split falls exactly there.
  * ``hs_<row>.safetensors`` per sample with ``hidden_states [T, 4, H]`` and ``token_ids [T]``. The peer flattens
    ``[:, :-1]`` into the fc input and feeds ``[:, -1]`` through the verifier's final norm and lm_head for its
    targets, so the 4 slots are our 3 aux layers (residual stream entering ``aux_layer_ids``, vLLM's convention,
    the one vLLM's capture gives the peer) in manifest order, then our last hidden state BEFORE the final norm.
    bf16-stored features are written in bf16 (exact); fp8-stored ones are written dequantised in float32.
  * the loss mask carries over unchanged, so the peer trains on exactly the tokens ours does (with our
    ``train.loss_positions: all``, an all-ones mask on the train rows; held-out rows keep the assistant mask).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from data_gen.store import FeatureDataset, read_manifest, read_token_counts
from speculators.atomic import atomic_directory, atomic_write_json, fsync_replace, temp_sibling
from speculators.vocab import DraftVocab, build_draft_vocab

CONVERSION_NAME = "conversion.json"
SOURCE_NAME = "source.json"


# ---- data ----------------------------------------------------------------------------------------------------
def source_fingerprint(data_dir: Path) -> dict[str, Any]:
    """What identifies the converted data: each split's shard hashes (a re-captured data dir differs here)."""
    return {
        split: [shard.get("sha256") for shard in read_manifest(data_dir / split)["shards"]]
        for split in ("train", "heldout")
    }


def peer_sample(sample: dict[str, Any], storage_dtype: str) -> dict[str, torch.Tensor]:
    """One sample in the peer's hs file layout: ``hidden_states [T, 4, H]`` (3 aux + last) and ``token_ids``."""
    aux, last = sample["aux_hidden"], sample["last_hidden"]
    tokens, hidden = last.shape
    stacked = torch.cat([aux.view(tokens, -1, hidden), last.view(tokens, 1, hidden)], dim=1)
    dtype = torch.bfloat16 if storage_dtype == "bfloat16" else torch.float32
    converted = stacked.to(dtype)
    if not torch.equal(converted.float(), stacked):
        raise ValueError(f"sample {sample['sample_id']}: features do not survive the cast to {dtype}")
    return {"hidden_states": converted.contiguous(), "token_ids": sample["input_ids"].to(torch.long)}


def write_atomic_safetensors(tensors: dict[str, torch.Tensor], target: Path) -> None:
    tmp = temp_sibling(target)
    try:
        save_file(tensors, str(tmp))
        fsync_replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def write_arrow_dataset(rows: dict[str, list], target: Path) -> None:
    """The peer's Arrow dataset (torch format, as its own preprocessing leaves it), written atomically."""
    from datasets import Dataset

    dataset = Dataset.from_dict(rows)
    dataset.set_format(type="torch")
    with atomic_directory(target) as staging:
        dataset.save_to_disk(str(staging))


def save_vocab_npy(vocab: DraftVocab, peer_data: Path) -> None:
    """Our d2t (int64 offsets) and t2d (bool) as the .npy files its ``--d2t-path/--t2d-path`` load."""
    for name, tensor in (("d2t", vocab.d2t), ("t2d", vocab.t2d)):
        target = peer_data / f"{name}.npy"
        tmp = temp_sibling(target)
        try:
            with open(tmp, "wb") as handle:
                np.save(handle, tensor.numpy())
            fsync_replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)


def draft_vocab_for(data_dir: Path, draft_vocab_size: int, vocab_file: Path | None) -> DraftVocab:
    """Our run's draft vocabulary: its saved file when given, else built from the data's token counts as ours is."""
    if vocab_file is not None:
        return DraftVocab.load(vocab_file)
    counts, provenance = read_token_counts(data_dir)
    return build_draft_vocab(counts, draft_vocab_size, provenance={"token_counts": provenance})


def convert_data(data_dir: Path, peer_data: Path, loss_positions: str = "assistant") -> dict[str, Any]:
    """Write the peer's data files for ``data_dir`` (skips samples already written; a finished conversion is reused).

    ``loss_positions`` is our ``train.loss_positions``: ``all`` writes an all-ones loss mask for the TRAIN rows (our
    trainer then trains on every token), while held-out rows keep the stored assistant mask (validation counts
    assistant tokens only, as ours does)."""
    if loss_positions not in ("assistant", "all"):
        raise ValueError(f"loss_positions must be 'assistant' or 'all', got {loss_positions!r}")
    fingerprint = {**source_fingerprint(data_dir), "loss_positions": loss_positions}
    done = peer_data / CONVERSION_NAME
    if done.exists():
        record = json.loads(done.read_text())
        if record["source_fingerprint"] != fingerprint:
            raise ValueError(
                f"{peer_data} holds a conversion of other data than {data_dir}; choose another --out or delete it"
            )
        return record
    source = peer_data / SOURCE_NAME
    if source.exists() and json.loads(source.read_text())["source_fingerprint"] != fingerprint:
        raise ValueError(
            f"{peer_data} holds a partial conversion of other data; choose another --out or delete it"
        )
    atomic_write_json(source, {"data_dir": str(data_dir), "source_fingerprint": fingerprint})
    hs_dir = peer_data / "hidden_states"
    hs_dir.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    counts, reused = {}, 0
    for split in ("train", "heldout"):
        dataset = FeatureDataset(data_dir / split)
        storage = dataset.manifest["storage_dtype"]
        counts[split] = len(dataset)
        for index in range(len(dataset)):
            row = len(rows["seq_len"])
            target = hs_dir / f"hs_{row}.safetensors"
            sample = dataset[index]
            if target.exists():  # written atomically by an earlier, interrupted conversion: complete
                reused += 1
            else:
                write_atomic_safetensors(peer_sample(sample, storage), target)
            ids, mask = sample["input_ids"], sample["loss_mask"]
            if split == "train" and loss_positions == "all":
                mask = torch.ones_like(mask)
            rows["input_ids"].append(ids.to(torch.long).tolist())
            rows["loss_mask"].append(mask.to(torch.long).tolist())
            rows["seq_len"].append(int(ids.shape[0]))
    write_arrow_dataset(rows, peer_data / "dataset")
    manifest = read_manifest(data_dir / "train")
    record = {
        "data_dir": str(data_dir),
        "source_fingerprint": fingerprint,
        "train_samples": counts["train"],
        "heldout_samples": counts["heldout"],
        "samples_reused": reused,
        # int(n * ratio) must land exactly on the train count: half a sample of slack absorbs float rounding
        "train_data_ratio": (counts["train"] + 0.5) / (counts["train"] + counts["heldout"]),
        "train_lengths": rows["seq_len"][: counts["train"]],
        "aux_layer_ids": manifest["aux_layer_ids"],
        "storage_dtype": manifest["storage_dtype"],
        "verifier": manifest["verifier"],
    }
    atomic_write_json(done, record)
    return record


def read_peer_sample(peer_data: Path, row: int) -> dict[str, torch.Tensor]:
    """One converted sample as the peer reads it: its hs file plus its dataset row (for checks and tests)."""
    from datasets import load_from_disk

    tensors = load_file(str(peer_data / "hidden_states" / f"hs_{row}.safetensors"))
    item = load_from_disk(str(peer_data / "dataset"))[row]
    return {
        **tensors,
        "input_ids": item["input_ids"],
        "loss_mask": item["loss_mask"],
        "seq_len": item["seq_len"],
    }
