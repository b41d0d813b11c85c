"""The P-EAGLE draft: an EAGLE-3 draft (speculators.algorithms.eagle3.model, unchanged) that proposes K tokens in ONE forward.

Read with eagle3.py, this file is the whole difference (docs/algorithms.md, "P-EAGLE"). After the verifier accepted
up to position e and emitted the bonus token x_{e+1}, one draft forward reads

    slot 0      position e      token x_{e+1}           feature fc(aux(e))          (EAGLE-3's ordinary input)
    slot d>=1   position e+d    token mask_token_id     feature fc(mask_hidden)     (one learned vector)

and slot d proposes the token at e+2+d. Attention is causal: a slot sees every accepted position (the draft's KV
cache holds them with their real features, as in EAGLE-3) and the slots before it. Nothing is chained from one
slot's output to the next slot's input: the slots are independent inputs that meet only in attention, which is why
one forward is enough. vLLM runs exactly this on its EAGLE-3 classes with ``parallel_drafting`` on; it precomputes
``fc(mask_hidden)`` once at load and writes it over the fc output of the mask slots.

``mask_hidden`` is a ``[1, 1, n_aux · H_verifier]`` parameter: it stands in for the concatenated verifier states,
so it passes through the same input norms and ``fc`` as they do.
"""

from __future__ import annotations

import torch
from torch import nn

from speculators.algorithms.eagle3.model import Eagle3DraftModel
from speculators.algorithms.peagle.config import PEagleConfig


class PEagleDraftModel(Eagle3DraftModel):
    """An EAGLE-3 draft plus ``mask_hidden``; the embedding trains when ``config.embed_requires_grad``."""

    config_class = PEagleConfig

    def __init__(self, config: PEagleConfig) -> None:
        super().__init__(config)
        width = len(config.eagle_aux_hidden_state_layer_ids) * config.verifier_hidden_size
        # speculators 0.9.0 starts it from N(0, 1): on the scale of normed verifier states
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, width))
        self.embed_tokens.weight.requires_grad_(config.embed_requires_grad)

    def mask_feature(self) -> torch.Tensor:
        """``fc(mask_hidden)`` ``[1, 1, H]``: the feature of every mask slot (vLLM computes it once at load)."""
        return self.project_features(self.mask_hidden)

    def slot_inputs(
        self, bonus_ids: torch.Tensor, bonus_features: torch.Tensor, depth: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and features of slot ``depth`` for every anchor: the bonus tokens ``[...]`` and their projected
        verifier features ``[..., H]`` at depth 0, else the mask token and ``fc(mask_hidden)`` broadcast to them."""
        if depth == 0:
            return bonus_ids, bonus_features
        return self.mask_slots(bonus_ids.shape, bonus_features)

    def mask_slots(
        self, shape: torch.Size | tuple[int, ...], like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids ``shape`` (all ``mask_token_id``) and features ``[*shape, H]`` (``fc(mask_hidden)``) of mask
        slots, on ``like``'s device and in its dtype."""
        ids = torch.full(tuple(shape), self.config.mask_token_id, dtype=torch.long, device=like.device)
        features = self.mask_feature().to(like.dtype).reshape(-1)
        return ids, features.expand(*shape, features.shape[0])


__all__ = ["PEagleDraftModel"]
