"""The draft vocabulary: which verifier tokens the draft's lm_head covers, stored as d2t offsets and a t2d mask.

Built from token counts over ASSISTANT tokens only (loss mask == 1), keeping the ``draft_vocab_size`` most frequent
(ties to the lower id; unseen ids pad from the lowest), sorted ascending. ``d2t = selected - arange(N)`` (offsets,
not ids) and ``t2d[selected] = True``. The provenance (tokenizer fingerprint, sizes, data) is stored alongside, and
``check_compatible`` refuses a mapping built for another tokenizer or size — a known silent failure elsewhere (a
second training stage, ``train.init_from``, checks its first stage's vocabulary with it).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


@dataclass
class DraftVocab:
    d2t: torch.Tensor  # [N] int64 offsets: target_id = draft_id + d2t[draft_id]
    t2d: torch.Tensor  # [V] bool
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.shape[0])

    @property
    def vocab_size(self) -> int:
        return int(self.t2d.shape[0])

    @property
    def target_ids(self) -> torch.Tensor:
        """The verifier ids of draft ids 0..N-1, ascending."""
        return torch.arange(self.draft_vocab_size) + self.d2t

    def save(self, path: str | Path) -> None:
        """Write ``<path>`` (safetensors) with the provenance in its metadata, atomically (a temporary sibling
        renamed into place: a run killed mid-write keeps the earlier file)."""
        from speculators.atomic import fsync_replace, temp_sibling

        path = Path(path)
        temporary = temp_sibling(path)
        try:
            save_file(
                {"d2t": self.d2t.contiguous(), "t2d": self.t2d.contiguous()},
                str(temporary),
                metadata={"provenance": json.dumps(self.provenance)},
            )
            fsync_replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: str | Path) -> DraftVocab:
        from speculators.format.checkpoint import read_weights_file

        tensors, metadata = read_weights_file(path)
        provenance = json.loads(metadata.get("provenance", "{}"))
        return cls(d2t=tensors["d2t"], t2d=tensors["t2d"], provenance=provenance)

    def check_compatible(
        self, tokenizer_fingerprint: str, draft_vocab_size: int, where: str = "draft vocab"
    ) -> None:
        """Refuse a mapping made for another tokenizer or size (reuse across them silently wrecks acceptance)."""
        built_for = self.provenance.get("tokenizer_fingerprint")
        if built_for and built_for != tokenizer_fingerprint:
            raise ValueError(
                f"{where} was built for tokenizer {built_for[:12]}…, not {tokenizer_fingerprint[:12]}…; "
                "rebuild it from token counts of this verifier's data"
            )
        if self.draft_vocab_size != draft_vocab_size:
            raise ValueError(
                f"{where} has {self.draft_vocab_size} draft tokens but the recipe asks for {draft_vocab_size}; "
                "rebuild it with the recipe's draft_vocab_size"
            )


def build_draft_vocab(
    token_counts: torch.Tensor, draft_vocab_size: int, provenance: dict[str, Any] | None = None
) -> DraftVocab:
    """Keep the ``draft_vocab_size`` most frequent ids (ties → lower id; unseen ids fill from the lowest)."""
    vocab_size = int(token_counts.shape[0])
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(
            f"draft_vocab_size {draft_vocab_size} must be in [1, {vocab_size}] (the verifier vocab)"
        )
    counts = token_counts.to(torch.float64)
    # A stable sort on -count keeps ascending id order among equal counts: ties go to the lower id.
    order = torch.sort(-counts, stable=True).indices
    selected = torch.sort(order[:draft_vocab_size]).values
    d2t = selected - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[selected] = True
    covered = float(counts[selected].sum() / counts.sum()) if counts.sum() > 0 else 0.0
    info = {
        "draft_vocab_size": draft_vocab_size,
        "vocab_size": vocab_size,
        "assistant_token_coverage": covered,
    }
    info.update(provenance or {})
    return DraftVocab(d2t=d2t.to(torch.long), t2d=t2d, provenance=info)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A stable hash of a tokenizer's vocabulary and special tokens (its identity, for provenance checks)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = sorted(map(str, getattr(tokenizer, "all_special_tokens", [])))
    payload = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False).encode()
    return hashlib.sha256(payload).hexdigest()


__all__ = ["DraftVocab", "build_draft_vocab", "tokenizer_fingerprint"]
