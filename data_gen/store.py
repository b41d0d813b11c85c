"""Feature storage: sharded safetensors + a manifest, written atomically, resumable, checksummed.

THE CONTRACT with the trainer (train/ reads exactly this; bump ``FORMAT_VERSION`` on any change)::

    <output_dir>/
      run_identity.json                 who made this data (verifier/tokenizer fingerprints, layer ids, settings);
                                        a run with another verifier or other settings refuses to write here
      train/   manifest.json  shard-00000.safetensors  shard-00001.safetensors ...
      heldout/ manifest.json  shard-XXXXX.safetensors ...      (never trained on: evaluation only)
      heldout_conversations.jsonl       normalised held-out conversations, one per line, OpenAI layout:
                                        {"id": str, "messages": [{"role": "system"|"user"|"assistant", "content"}]}
      token_counts.safetensors          "counts" int64 [V]: train-split ASSISTANT tokens (loss_mask == 1) per
                                        verifier token id; provenance JSON in the metadata (key "provenance")

    Reader:  FeatureDataset(split_dir)[i] -> {
        "sample_id":   str,
        "input_ids":   LongTensor  [T],
        "loss_mask":   BoolTensor  [T]        1 on assistant content + its end-of-turn token,
        "aux_hidden":  FloatTensor [T, n*H]   dequantised float32; residual streams ENTERING layers
                                              manifest["aux_layer_ids"] (vLLM convention), concatenated in that order,
        "last_hidden": FloatTensor [T, H]     output of the last decoder layer BEFORE the final norm,
        "loss_weight": FloatTensor [T]        ONLY when the shard holds weights (error replay, data_gen.regenerate
                                              .backend=engine): the weight of the loss at each token, 0 outside the
                                              loss mask, mean 1.0 over the sample's loss tokens (rejected draft
                                              tokens weigh more); a trainer multiplies each target token's loss by
                                              it. No key: every loss token weighs 1.
    }
    FeatureDataset(split_dir, dequantize=False)[i] keeps the features as stored (bf16, or fp8 plus float32
        "aux_scale" [T, n] / "last_scale" [T, 1]) for a consumer that dequantises later, on its device.
    FeatureDataset(split_dir).manifest -> dict with at least: aux_layer_ids, layer_convention, num_hidden_layers,
        hidden_size, vocab_size, storage_dtype, verifier {name_or_path, architectures, fingerprint},
        tokenizer {fingerprint, ...}, num_samples, num_tokens, num_loss_tokens, shards [...].

    Online training gets the same tensors from :class:`data_gen.capture.FeatureCapture`.

    ``loss_weight`` did not bump ``FORMAT_VERSION``: it is optional, so this reader reads every older shard as it
    was read before (no key); a reader older than it ignores the tensor and trains unweighted.

Shard file (one safetensors file; samples packed along the token axis, no padding stored):
    input_ids int32 [N], loss_mask bool [N], offsets int64 [S+1] (sample s = rows offsets[s]:offsets[s+1]),
    aux_hidden [N, n*H] and last_hidden [N, H] in bf16, or in float8_e4m3fn with float32 scales
    aux_scale [N, n] (one per token per aux layer: layers differ in magnitude) and last_scale [N, 1];
    loss_weight float32 [N] only when a sample of the shard has weights (the others get their loss mask as
    1.0/0.0); a shard without weights has no such tensor, byte for byte the shard of before error replay;
    metadata key "speculators_train": JSON {"format", "format_version", "sample_ids"} (a single key keeps the bytes
    of a rewritten shard identical: safetensors orders several metadata keys by hash).

Writing: each shard goes to a temporary name, is hashed (sha256), fsynced and renamed; then its record
``shard-XXXXX.json`` (sample ids, token counts, sha256, bytes) is written the same way. A shard counts as done only
when its record exists and its sha256 matches, so a run killed at any point resumes at the first missing shard and
never duplicates or loses a sample. Rank 0 merges the records into ``manifest.json`` once all shards exist. The
reader checks every shard's sha256 once per process, the first time it opens it or up front with
``verify_shards()`` before DataLoader workers start (they inherit the result instead of re-hashing); a corrupted
shard raises CorruptShardError.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import Dataset

from speculators.atomic import atomic_write_json, fsync_replace, temp_sibling

FORMAT_NAME = "speculators-train/features"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
IDENTITY_NAME = "run_identity.json"
TOKEN_COUNTS_NAME = "token_counts.safetensors"
HELDOUT_CONVERSATIONS_NAME = "heldout_conversations.jsonl"
SPLITS = ("train", "heldout")
STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


class CorruptShardError(RuntimeError):
    """A shard's bytes do not match the sha256 its manifest lists (the message says whether the shard or the
    manifest is the damaged one, when its record can tell)."""


class IncompatibleOutputError(RuntimeError):
    """The output directory holds data made by another verifier or with other settings."""


# ---- paths and atomic files ---------------------------------------------------------------------------------
def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def record_name(index: int) -> str:
    return f"shard-{index:05d}.json"


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def remove_stale_temporaries(directory: str | Path) -> int:
    """Delete temporaries a killed run left behind; returns how many.

    Two kinds: ours (``.name.tmp-*``, see ``speculators.atomic``) and safetensors' own. Since 0.8,
    ``save_file`` itself writes to ``.tmpXXXXXX`` beside its target and renames, so a SIGKILL during
    a shard's save leaves that file too, one level below our atomic rename.
    """
    directory = Path(directory)
    removed = 0
    if directory.is_dir():
        for pattern in (".*.tmp-*", ".tmp*"):
            for path in directory.glob(pattern):
                if path.is_file():
                    path.unlink(missing_ok=True)
                    removed += 1
    return removed


# ---- quantisation -------------------------------------------------------------------------------------------
def quantize(x: torch.Tensor, groups: int, storage_dtype: str) -> dict[str, torch.Tensor]:
    """``x`` [N, groups*H] → stored tensors: bf16 as is, or fp8 e4m3 with one float32 scale per row and group."""
    if storage_dtype == "bfloat16":
        return {"values": x.to(torch.bfloat16).contiguous()}
    if storage_dtype != "fp8":
        raise ValueError(f"unknown storage_dtype {storage_dtype!r}; use bfloat16 or fp8")
    rows = x.shape[0]
    grouped = x.float().reshape(rows, groups, -1)
    scale = (grouped.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    values = (grouped / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(rows, -1)
    return {"values": values.contiguous(), "scale": scale.reshape(rows, groups).contiguous()}


def dequantize(values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Stored tensors → float32 [N, groups*H]."""
    if scale is None:
        return values.float()
    rows, groups = scale.shape
    return (values.float().reshape(rows, groups, -1) * scale.reshape(rows, groups, 1)).reshape(rows, -1)


# ---- writing ------------------------------------------------------------------------------------------------
@dataclass
class Sample:
    """One captured sample as the pipeline hands it to :func:`write_shard` (features on CPU, any float dtype)."""

    sample_id: str
    input_ids: torch.Tensor  # [T] int
    loss_mask: torch.Tensor  # [T] bool
    aux_hidden: torch.Tensor  # [T, n*H]
    last_hidden: torch.Tensor  # [T, H]
    loss_weight: torch.Tensor | None = None  # [T] float32, error replay (see the module contract)


def pack_samples(samples: Sequence[Sample], num_aux: int, storage_dtype: str) -> dict[str, torch.Tensor]:
    """Concatenate samples along the token axis and quantise the features for storage."""
    lengths = [int(s.input_ids.shape[0]) for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    if samples:
        ids = torch.cat([s.input_ids.to(torch.int32) for s in samples])
        mask = torch.cat([s.loss_mask.to(torch.bool) for s in samples])
        aux = torch.cat([s.aux_hidden for s in samples])
        last = torch.cat([s.last_hidden for s in samples])
    else:  # a shard whose conversations were all dropped still gets a (tiny) file: it is "done"
        ids, mask = torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.bool)
        aux, last = torch.zeros(0, num_aux), torch.zeros(0, 1)
    tensors = {"input_ids": ids.contiguous(), "loss_mask": mask.contiguous(), "offsets": offsets}
    if any(s.loss_weight is not None for s in samples):
        tensors["loss_weight"] = pack_loss_weights(samples)
    aux_q, last_q = quantize(aux, num_aux, storage_dtype), quantize(last, 1, storage_dtype)
    tensors["aux_hidden"] = aux_q["values"]
    tensors["last_hidden"] = last_q["values"]
    if "scale" in aux_q:
        tensors["aux_scale"], tensors["last_scale"] = aux_q["scale"], last_q["scale"]
    return tensors


def pack_loss_weights(samples: Sequence[Sample]) -> torch.Tensor:
    """float32 [N]: each sample's weights, or its loss mask as 1.0/0.0 when it has none (a shard mixes both when
    some of its conversations were not regenerated with a draft, e.g. a one-token answer)."""
    for s in samples:
        if s.loss_weight is not None and s.loss_weight.shape != s.loss_mask.shape:
            raise ValueError(
                f"{s.sample_id!r}: loss_weight has shape {tuple(s.loss_weight.shape)}, its loss mask "
                f"{tuple(s.loss_mask.shape)}"
            )
    return torch.cat(
        [(s.loss_weight if s.loss_weight is not None else s.loss_mask).to(torch.float32) for s in samples]
    ).contiguous()


def write_shard(
    split_dir: str | Path,
    index: int,
    samples: Sequence[Sample],
    num_aux: int,
    storage_dtype: str,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Atomically write shard ``index`` and then its record (plus ``extra`` fields, e.g. drop counts); returns the
    record, which is also what the manifest lists for this shard."""
    split_dir = Path(split_dir)
    split_dir.mkdir(parents=True, exist_ok=True)
    target = split_dir / shard_name(index)
    tensors = pack_samples(samples, num_aux, storage_dtype)
    ids = [s.sample_id for s in samples]
    tmp = temp_sibling(target)
    try:
        # ONE metadata key: safetensors writes a metadata dict in hash order, so several keys would make two
        # writes of the same shard differ in bytes (and in sha256) from run to run.
        header = json.dumps({"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "sample_ids": ids})
        save_file(tensors, str(tmp), metadata={"speculators_train": header})
        digest = sha256_file(tmp)
        size = tmp.stat().st_size
        fsync_replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    lengths = (tensors["offsets"][1:] - tensors["offsets"][:-1]).tolist()
    loss_tokens = [
        int(tensors["loss_mask"][a:b].sum())
        for a, b in zip(tensors["offsets"][:-1], tensors["offsets"][1:], strict=True)
    ]
    record = {
        "index": index,
        "file": target.name,
        "sha256": digest,
        "bytes": size,
        "num_samples": len(samples),
        "num_tokens": int(sum(lengths)),
        "num_loss_tokens": int(sum(loss_tokens)),
        "sample_ids": ids,
        "sample_tokens": lengths,
        "sample_loss_tokens": loss_tokens,
    }
    record.update(extra or {})
    atomic_write_json(split_dir / record_name(index), record)
    return record


def done_record(split_dir: str | Path, index: int, verify: bool = True) -> dict[str, Any] | None:
    """The record of a finished shard, or ``None`` when the shard must be (re)made.

    A record without its shard, or whose shard's sha256 differs (a half-copied or damaged file), means "redo".
    """
    split_dir = Path(split_dir)
    record_path, shard_path = split_dir / record_name(index), split_dir / shard_name(index)
    if not record_path.exists() or not shard_path.exists():
        return None
    try:
        record = json.loads(record_path.read_text())
    except json.JSONDecodeError:
        return None
    if shard_path.stat().st_size != record.get("bytes"):
        return None
    if verify and sha256_file(shard_path) != record.get("sha256"):
        return None
    return record


def finalize_split(split_dir: str | Path, num_shards: int, header: dict[str, Any]) -> dict[str, Any]:
    """Merge the shard records into ``manifest.json`` (atomically); refuses when a shard is missing."""
    split_dir = Path(split_dir)
    records = []
    missing = []
    for index in range(num_shards):
        record_path = split_dir / record_name(index)
        if not record_path.exists() or not (split_dir / shard_name(index)).exists():
            missing.append(index)
            continue
        records.append(json.loads(record_path.read_text()))
    if missing:
        raise RuntimeError(
            f"{split_dir}: shards {missing[:10]}{'…' if len(missing) > 10 else ''} are missing "
            f"({len(missing)} of {num_shards}); a rank failed or stopped — rerun data_gen to resume"
        )
    manifest = dict(header)
    manifest.update(
        {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "split": split_dir.name,
            "num_shards": num_shards,
            "num_samples": sum(r["num_samples"] for r in records),
            "num_tokens": sum(r["num_tokens"] for r in records),
            "num_loss_tokens": sum(r["num_loss_tokens"] for r in records),
            "bytes": sum(r["bytes"] for r in records),
            "shards": records,
        }
    )
    atomic_write_json(split_dir / MANIFEST_NAME, manifest)
    return manifest


# ---- run identity (refuse to mix data from different verifiers or settings) --------------------------------
def check_or_write_identity(output_dir: str | Path, identity: dict[str, Any], write: bool = True) -> None:
    """Compare ``identity`` with the one stored in ``output_dir``; store it when the directory is new.

    Mixing shards made by two verifiers (or two chat templates, layer sets, lengths…) silently trains a draft on
    inconsistent targets, so any difference is refused with the fields that differ and the fix.
    """
    output_dir = Path(output_dir)
    path = output_dir / IDENTITY_NAME
    if path.exists():
        stored = json.loads(path.read_text())
        diffs = _differences(stored, identity)
        if diffs:
            shown = "; ".join(f"{key}: stored {a!r} vs now {b!r}" for key, a, b in diffs[:6])
            raise IncompatibleOutputError(
                f"{output_dir} already holds features made with a different verifier or settings ({shown}). "
                "Choose another data_gen.output_dir, or delete that directory to start over."
            )
        return
    if any(output_dir.glob("*/shard-*")):
        raise IncompatibleOutputError(
            f"{output_dir} holds feature shards but no {IDENTITY_NAME}, so their origin is unknown; "
            "choose another data_gen.output_dir or delete that directory"
        )
    if write:
        atomic_write_json(path, identity)


def _differences(stored: Any, current: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(stored, dict) and isinstance(current, dict):
        diffs = []
        for key in sorted(set(stored) | set(current)):
            diffs += _differences(stored.get(key), current.get(key), f"{prefix}{key}.")
        return diffs
    return [] if stored == current else [(prefix.rstrip("."), stored, current)]


# ---- reading ------------------------------------------------------------------------------------------------
def read_manifest(split_dir: str | Path) -> dict[str, Any]:
    split_dir = Path(split_dir)
    path = split_dir / MANIFEST_NAME
    if not path.exists():
        partial = sorted(split_dir.glob("shard-*.json")) if split_dir.is_dir() else []
        hint = (
            f"{len(partial)} shard records exist, so data_gen did not finish: rerun it to resume"
            if partial
            else "run data_gen first (accelerate launch data_gen/run.py recipe=...)"
        )
        raise FileNotFoundError(f"{split_dir}: no {MANIFEST_NAME}; {hint}")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT_NAME or manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: format {manifest.get('format')!r} v{manifest.get('format_version')} is not "
            f"{FORMAT_NAME!r} v{FORMAT_VERSION}; regenerate the features with this version of data_gen"
        )
    return manifest


class FeatureDataset(Dataset):
    """The samples of one split directory (``<output_dir>/train`` or ``/heldout``), see the module contract.

    Shards are memory-mapped lazily (one open shard per process, so DataLoader workers each open their own). Each
    shard's sha256 is checked once: the first time this process opens it, or all at once by :meth:`verify_shards`
    in the main process, whose result DataLoader workers inherit (``verify=False`` skips it). ``dequantize=False``
    returns the features in their storage dtype (see the module contract).
    """

    def __init__(self, split_dir: str | Path, verify: bool = True, dequantize: bool = True) -> None:
        self.split_dir = Path(split_dir)
        self.manifest = read_manifest(self.split_dir)
        self.verify = verify
        self.dequantize = dequantize
        self._index: list[tuple[int, int]] = []  # global item -> (shard position, sample within shard)
        self._ids: list[str] = []
        for position, shard in enumerate(self.manifest["shards"]):
            for local, sample_id in enumerate(shard["sample_ids"]):
                self._index.append((position, local))
                self._ids.append(sample_id)
        self._verified: set[int] = set()
        self._open: tuple[int, Any, torch.Tensor] | None = None

    def verify_shards(self, items: Sequence[int] | None = None) -> None:
        """Hash now every shard holding ``items`` (default: all) that this process has not checked yet.

        Called before DataLoader workers start, so they inherit the verified set: each shard is read for its
        hash once per rank, not once per worker."""
        positions = (
            range(len(self.manifest["shards"])) if items is None else {self._index[i][0] for i in items}
        )
        for position in sorted(positions):
            self._check(position)

    def _check(self, position: int) -> Path:
        record = self.manifest["shards"][position]
        path = self.split_dir / record["file"]
        if not path.exists():
            raise CorruptShardError(
                f"{path} is missing; rerun data_gen on {self.split_dir.parent} to rebuild it"
            )
        if self.verify and position not in self._verified:
            if path.stat().st_size != record["bytes"] or sha256_file(path) != record["sha256"]:
                raise CorruptShardError(self._disagreement(path, record))
            self._verified.add(position)
        return path

    def _disagreement(self, path: Path, listed: dict[str, Any]) -> str:
        """Why the shard at ``path`` and the manifest's entry ``listed`` disagree, judged by the third witness,
        the shard's own record ``shard-XXXXX.json``: the odd one out is the damaged file, and an intact shard is
        never called corrupted because the manifest was edited or copied from another run."""
        manifest = self.split_dir / MANIFEST_NAME
        record_path = self.split_dir / record_name(listed["index"])
        own = _read_json(record_path)
        actual = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
        if own is not None and _same_bytes(own, actual):
            return (
                f"{manifest} lists a sha256 for {path.name} that the shard does not have, but the shard matches "
                f"its own record {record_path}: the manifest is the odd one out (edited, or copied from another "
                f"run), the shard is intact. Rerun data_gen with the same recipe on {self.split_dir.parent}: it "
                "rewrites the manifest from the shard records"
            )
        if own is not None and _same_bytes(own, listed):
            return (
                f"{path} is corrupted (sha256 differs from the manifest and from its record {record_path}). "
                f"Delete it and {record_path.name}, then rerun data_gen with the same recipe to rebuild it"
            )
        return (
            f"{path} and {manifest} disagree about the shard's sha256, and its record {record_path} "
            f"{'is missing' if own is None else 'agrees with neither'}, so which is damaged cannot be told. Delete "
            f"{path.name} and {record_path.name}, then rerun data_gen with the same recipe on "
            f"{self.split_dir.parent}: it rebuilds the shard and rewrites the manifest"
        )

    def __len__(self) -> int:
        return len(self._index)

    @property
    def sample_ids(self) -> list[str]:
        return list(self._ids)

    def lengths(self) -> list[int]:
        """Token count of every item (for length-grouped batching), read from the manifest."""
        return [n for shard in self.manifest["shards"] for n in shard["sample_tokens"]]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_open"] = None  # safetensors handles are per process
        return state

    def _shard(self, position: int) -> tuple[Any, torch.Tensor]:
        if self._open is not None and self._open[0] == position:
            return self._open[1], self._open[2]
        path = self._check(position)
        handle = safe_open(str(path), framework="pt")
        offsets = handle.get_tensor("offsets")
        self._open = (position, handle, offsets)
        return handle, offsets

    def __getitem__(self, item: int) -> dict[str, Any]:
        if item < 0:
            item += len(self)
        position, local = self._index[item]
        handle, offsets = self._shard(position)
        start, stop = int(offsets[local]), int(offsets[local + 1])
        keys = set(handle.keys())

        def rows(name: str) -> torch.Tensor:
            return handle.get_slice(name)[start:stop]

        sample = {
            "sample_id": self._ids[item],
            "input_ids": rows("input_ids").long(),
            "loss_mask": rows("loss_mask").bool(),
        }
        if "loss_weight" in keys:
            sample["loss_weight"] = rows("loss_weight").float()
        for name, scale_name in (("aux_hidden", "aux_scale"), ("last_hidden", "last_scale")):
            values, scale = rows(name), rows(scale_name) if scale_name in keys else None
            if self.dequantize:
                sample[name] = dequantize(values, scale)
            else:
                sample[name] = values
                if scale is not None:
                    sample[scale_name] = scale
        return sample


def _read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when it is missing or unreadable."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _same_bytes(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two descriptions of a shard (record, manifest entry, the file itself) name the same bytes."""
    return a.get("sha256") == b.get("sha256") and a.get("bytes") == b.get("bytes")


def read_token_counts(output_dir: str | Path) -> tuple[torch.Tensor, dict[str, Any]]:
    """``(counts int64 [V], provenance)`` from ``<output_dir>/token_counts.safetensors``."""
    path = Path(output_dir) / TOKEN_COUNTS_NAME
    with safe_open(str(path), framework="pt") as handle:
        provenance = json.loads((handle.metadata() or {}).get("provenance", "{}"))
        counts = handle.get_tensor("counts")
    return counts, provenance


__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "CorruptShardError",
    "FeatureDataset",
    "IncompatibleOutputError",
    "Sample",
    "read_manifest",
    "read_token_counts",
    "write_shard",
]
