"""What every draft model shares: the draft-vocabulary mapping (d2t offsets, t2d mask) and checkpoint I/O under
the standard, unprefixed tensor names. A draft architecture subclasses :class:`DraftModel`, names its config class
and registers ``d2t`` / ``t2d`` buffers with :meth:`register_vocab`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from speculators.format.checkpoint import load_checkpoint, save_checkpoint
from speculators.format.config import verifier_name_or_path

# The original EAGLE-3 layout names layer 0 `midlayer`; vLLM accepts it as an alias.
LEGACY_PREFIXES = {"midlayer.": "layers.0."}


class DraftModel(nn.Module):
    """Base of the draft architectures: vocabulary mapping and the speculators checkpoint round trip."""

    config_class: ClassVar[Any]
    d2t: torch.Tensor
    t2d: torch.Tensor

    def register_vocab(self, draft_vocab_size: int, vocab_size: int) -> None:
        """d2t holds OFFSETS (target_id = draft_id + d2t[draft_id]); t2d marks verifier ids kept in the draft
        vocab. The identity mapping until :meth:`set_vocab`."""
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(vocab_size, dtype=torch.bool))
        self.t2d[:draft_vocab_size] = True

    # ---- vocabulary ----------------------------------------------------------------------------------------
    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to verifier ids through the d2t offsets."""
        return draft_ids + self.d2t[draft_ids]

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t.to(torch.long))
        self.t2d.copy_(t2d.to(torch.bool))

    def expand_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits → verifier-vocab logits (``-inf`` outside the draft vocabulary), as vLLM does."""
        full = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), float("-inf"))
        full[
            ..., self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=draft_logits.device))
        ] = draft_logits
        return full

    # ---- checkpoint I/O ------------------------------------------------------------------------------------
    def export_state_dict(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """Tensors under the standard names: float weights in ``dtype``, d2t int64, t2d bool, embed_tokens always."""
        tensors = {}
        for name, tensor in self.state_dict().items():
            if name in ("d2t", "t2d"):
                continue
            tensors[name] = tensor.detach().to(dtype).contiguous()
        if self.config.draft_vocab_size != self.config.vocab_size:
            tensors["d2t"] = self.d2t.detach().to(torch.long).clone()
            tensors["t2d"] = self.t2d.detach().to(torch.bool).clone()
        return tensors

    def save_pretrained(
        self, directory: str | Path, dtype: torch.dtype = torch.bfloat16, extra_files: dict | None = None
    ) -> Path:
        """Write a standard speculators checkpoint (atomically)."""
        self.config.torch_dtype = str(dtype).removeprefix("torch.")
        return save_checkpoint(directory, self.config.to_dict(), self.export_state_dict(dtype), extra_files)

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, dtype: torch.dtype = torch.float32, embed_from_verifier: bool = False
    ) -> Any:
        """Load a speculators checkpoint of this class's type (``midlayer.`` names accepted as vLLM does).

        ``embed_from_verifier`` (the algorithm unit's declaration): a checkpoint without ``embed_tokens.weight``
        takes the verifier's embedding, as the consumers do for that type (speculators 0.9.0's DFlash saves none)."""
        config_dict, tensors = load_checkpoint(directory)
        if embed_from_verifier and "embed_tokens.weight" not in tensors:
            tensors["embed_tokens.weight"] = embedding_of_named_verifier(config_dict, directory)
        model = cls(cls.config_class.from_dict(config_dict))
        model.load_standard_tensors(tensors, source=str(directory))
        return model.to(dtype)

    def load_standard_tensors(self, tensors: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
        """Load tensors under the standard names; raises naming the missing and unexpected ones."""
        renamed = {}
        for name, tensor in tensors.items():
            for old, new in LEGACY_PREFIXES.items():
                if name.startswith(old):
                    name = new + name[len(old) :]
            renamed[name] = tensor
        expected = set(self.state_dict())
        if self.config.draft_vocab_size == self.config.vocab_size:
            renamed.setdefault("d2t", torch.zeros(self.config.draft_vocab_size, dtype=torch.long))
            renamed.setdefault("t2d", torch.ones(self.config.vocab_size, dtype=torch.bool))
        missing = sorted(expected - set(renamed))
        unexpected = sorted(set(renamed) - expected)
        if missing or unexpected:
            raise ValueError(
                f"{source}: tensors do not match the config (missing {missing}, unexpected {unexpected}); "
                "run `speculators validate` for details"
            )
        own = self.state_dict()
        self.load_state_dict({k: v.to(own[k].dtype) for k, v in renamed.items()})


def embedding_of_named_verifier(config: dict[str, Any], directory: str | Path) -> torch.Tensor:
    """The embedding of the verifier a checkpoint's config names, for a checkpoint that stores none."""
    from speculators.verifier import verifier_embedding

    name = verifier_name_or_path(config)
    if not name:
        raise ValueError(
            f"{Path(directory) / 'config.json'}: the checkpoint stores no embed_tokens.weight and names no verifier "
            "(speculators_config.verifier.name_or_path) to take it from; set it to the verifier's directory or hub id"
        )
    try:
        return verifier_embedding(name)
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(
            f"{Path(directory) / 'config.json'}: the checkpoint stores no embed_tokens.weight and its verifier "
            f"{name!r} cannot be read for it ({exc}); make the verifier available locally or write its embedding"
        ) from exc
