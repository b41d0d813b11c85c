"""Token-frequency statistics for the draft vocabulary (d2t/t2d): counts of ASSISTANT tokens only.

Counting prompt tokens too would spend draft vocabulary on tokens the draft never has to propose. The counts are
read back from the finished train shards (input_ids where loss_mask is set), so they describe exactly the data the
draft trains on, and are written with their provenance (tokenizer fingerprint, verifier, data) because a mapping
reused with another tokenizer is a known silent failure.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from data_gen.store import TOKEN_COUNTS_NAME, read_manifest
from speculators.atomic import fsync_replace, temp_sibling


def count_assistant_tokens(split_dir: str | Path, vocab_size: int) -> torch.Tensor:
    """``int64 [vocab_size]``: how often each token id appears with loss_mask == 1 in the split's shards."""
    split_dir = Path(split_dir)
    manifest = read_manifest(split_dir)
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for shard in manifest["shards"]:
        with safe_open(str(split_dir / shard["file"]), framework="pt") as handle:
            ids = handle.get_tensor("input_ids").long()
            mask = handle.get_tensor("loss_mask").bool()
        selected = ids[mask]
        if selected.numel() and int(selected.max()) >= vocab_size:
            raise ValueError(
                f"{split_dir / shard['file']}: token id {int(selected.max())} >= vocab size {vocab_size}; "
                "the tokenizer does not match the verifier"
            )
        counts += torch.bincount(selected, minlength=vocab_size)
    return counts


def write_token_counts(output_dir: str | Path, counts: torch.Tensor, provenance: dict[str, Any]) -> Path:
    """Atomically write ``token_counts.safetensors`` (``counts`` int64 [V] + provenance JSON metadata)."""
    target = Path(output_dir) / TOKEN_COUNTS_NAME
    tmp = temp_sibling(target)
    try:
        save_file(
            {"counts": counts.to(torch.int64).contiguous()},
            str(tmp),
            metadata={"provenance": json.dumps(provenance)},
        )
        fsync_replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


__all__ = ["count_assistant_tokens", "write_token_counts"]
