"""The k-step training-time-test unroll as ONE module forward.

DDP and DeepSpeed expect exactly one forward per backward of the module they wrap, so the whole unroll (feature
projection, k drafting steps sharing one :class:`TTTAttention`) lives in :meth:`TTTDraft.forward`, which returns
the draft-vocabulary logits of every step (k tensors ``[B, L, Vd]``).

Step j (0-based) at position t feeds token x_{t+1+j} at rope position ``position_ids + j`` (the position the
token has at inference, as vLLM's proposer advances it), and as hidden input either the projected verifier feature
(j = 0) or the draft's own output of step j-1. HASS's harmonized context alignment feeds that output detached.
Feature noise is added per document when the batch is built (``train.data``), independent of the process layout
and of RNG state.
"""

from __future__ import annotations

import torch
from torch import nn

from speculators.algorithms.eagle3.model import Eagle3DraftModel
from train.losses import shift_left
from train.ttt_attention import TTTAttention


class TTTDraft(nn.Module):
    """Wraps an :class:`Eagle3DraftModel` (its parameters are ``draft.*``) with the TTT unroll."""

    def __init__(
        self,
        draft: Eagle3DraftModel,
        steps: int,
        detach_context: bool = False,
        attention_backend: str = "auto",
        chunk_size: int = 256,
    ) -> None:
        super().__init__()
        if steps < 1:
            raise ValueError(f"train.ttt_steps={steps}: the unroll needs at least one step")
        self.draft = draft
        self.steps = steps
        self.detach_context = detach_context
        self.attention_backend = attention_backend
        self.chunk_size = chunk_size

    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        document_ids: torch.Tensor,
        steps: int | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """k tensors ``[B, L, draft V]``; ``steps`` overrides k (evaluation may unroll further than training)."""
        steps = steps or self.steps
        hidden = self.draft.project_features(aux_hidden.to(self.draft.fc.weight.dtype))
        attend = TTTAttention(
            document_ids,
            self.attention_backend,
            self.chunk_size,
            total_steps=steps,
            windows=self.draft.config.layer_windows,
        )
        logits = []
        for j in range(steps):
            step_logits, hidden = self.draft(shift_left(input_ids, 1 + j), hidden, position_ids + j, attend)
            logits.append(step_logits)
            if self.detach_context:
                hidden = hidden.detach()
        return tuple(logits)  # no stacked copy of k × [B, L, Vd]


__all__ = ["TTTDraft"]
