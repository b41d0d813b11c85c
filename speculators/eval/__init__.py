"""Evaluation of a draft with the decoding engine: prompts, acceptance, speedup, plots (``speculators eval``).

``from speculators.eval import evaluate`` is the API the trainer and the demo call; the module is imported lazily
so that ``speculators.eval.prompts`` stays light."""

from __future__ import annotations

from typing import Any


def evaluate(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """See :func:`speculators.eval.evaluation.evaluate` (imported on first use: it pulls in the engine)."""
    from speculators.eval.evaluation import evaluate as _evaluate

    return _evaluate(*args, **kwargs)


__all__ = ["evaluate"]
