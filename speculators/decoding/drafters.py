"""Which drafter decodes which draft: the one place that maps an algorithm's ``drafting`` to the engine's class.

The engine and ``speculators eval`` look a draft's algorithm up by its config's ``speculators_model_type`` and take
the drafter its ``drafting`` names, so a new algorithm that drafts sequentially or in blocks needs no engine change.
"""

from __future__ import annotations

from typing import Any

from speculators import algorithms
from speculators.decoding.block_drafter import BlockDrafter
from speculators.decoding.drafter import Drafter
from speculators.decoding.parallel_drafter import ParallelDrafter

DRAFTERS: dict[str, type] = {"sequential": Drafter, "parallel": ParallelDrafter, "block": BlockDrafter}


def algorithm_of(draft: Any) -> algorithms.Algorithm:
    """The algorithm unit of a loaded draft model (by its config's type)."""
    return algorithms.get(draft.config.SPECULATORS_MODEL_TYPE)


def drafter_class(draft: Any) -> type:
    """The drafter class that decodes ``draft``."""
    algorithm = algorithm_of(draft)
    if algorithm.drafting not in DRAFTERS:
        raise ValueError(
            f"{algorithm.name} drafts {algorithm.drafting!r}, which the engine cannot decode: one of {sorted(DRAFTERS)}"
        )
    return DRAFTERS[algorithm.drafting]


def default_k(draft: Any) -> int:
    """The chain length to evaluate when none is given: 3 for sequential drafts, the whole block for block ones."""
    return int(drafter_class(draft).default_k(draft.config))


__all__ = ["DRAFTERS", "algorithm_of", "default_k", "drafter_class"]
