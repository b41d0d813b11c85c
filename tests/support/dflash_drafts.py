"""Random DFlash drafts for engine and evaluation tests (shaped after a verifier, optionally with a real reduced
vocabulary), importable from any test directory."""

from __future__ import annotations

import torch
from torch import nn

from speculators.algorithms.dflash.config import DFlashConfig
from speculators.algorithms.dflash.model import DFlashDraftModel
from speculators.vocab import build_draft_vocab


def random_dflash_draft(
    verifier: nn.Module,
    block_size: int = 5,
    block_causal: bool = True,
    token_counts: torch.Tensor | None = None,
    draft_vocab_size: int | None = None,
    seed: int = 1,
    mask_token_id: int = 3,
) -> DFlashDraftModel:
    """A random DFlash draft for ``verifier``; with ``token_counts`` its vocabulary is the ``draft_vocab_size``
    most frequent ids (the real d2t/t2d of ``speculators.vocab.build_draft_vocab``)."""
    torch.manual_seed(seed)
    vocab = verifier.config.vocab_size
    size = draft_vocab_size or vocab
    config = DFlashConfig.from_verifier(
        verifier.config.to_dict(),
        "in-memory",
        mask_token_id=mask_token_id,
        draft_vocab_size=size,
        block_size=block_size,
        block_causal=block_causal,
        torch_dtype="float32",
    )
    draft = DFlashDraftModel(config).eval().requires_grad_(False)
    if token_counts is not None:
        mapping = build_draft_vocab(token_counts, size)
        draft.set_vocab(mapping.d2t, mapping.t2d)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(verifier.get_input_embeddings().weight)
    return draft
