"""Typed ``config.json`` of a DSpark draft: DFlash's (speculators.algorithms.dflash.config) plus its heads' keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from speculators.algorithms.dflash.config import DFlashConfig


@dataclass
class DSparkConfig(DFlashConfig):
    """config.json of a DSpark draft: DFlash plus a low-rank Markov logit bias from the previous block token
    (``markov_w1`` [V, r] embedding, ``markov_w2`` [r → draft V]) and a confidence head vLLM does not use."""

    SPECULATORS_MODEL_TYPE: ClassVar[str] = "dspark"
    ARCHITECTURE: ClassVar[str] = "DSparkSpeculator"
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = False


__all__ = ["DSparkConfig"]
