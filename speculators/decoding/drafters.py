"""Which drafter decodes which draft: each algorithm unit names its drafter class (``Algorithm.drafter_class``).

The engine and ``speculators eval`` look a draft's algorithm up by its config's ``speculators_model_type`` and take
the drafter it declares, so a new algorithm needs no engine change.
"""

from __future__ import annotations

from typing import Any

from speculators import algorithms


def algorithm_of(draft: Any) -> algorithms.Algorithm:
    """The algorithm unit of a loaded draft model (by its config's type)."""
    return algorithms.get(draft.config.SPECULATORS_MODEL_TYPE)


def drafter_class(draft: Any) -> type:
    """The drafter class that decodes ``draft``."""
    return algorithm_of(draft).drafter_class


def default_k(draft: Any) -> int:
    """The chain length to evaluate when none is given: 3 for sequential drafts, the whole block for block ones."""
    return int(drafter_class(draft).default_k(draft.config))


__all__ = ["algorithm_of", "default_k", "drafter_class"]
