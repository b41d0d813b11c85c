"""Draft models."""

from speculators.models.eagle3 import Eagle3DraftModel

__all__ = ["Eagle3DraftModel"]
