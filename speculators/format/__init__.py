"""The speculators checkpoint format: typed config, checkpoint read/write, and the validator's rules."""

from speculators.format.checkpoint import load_checkpoint, save_checkpoint
from speculators.format.config import (
    ProposalMethod,
    SpeculatorsConfig,
    VerifierRef,
)
from speculators.format.validate import Finding, validate_checkpoint

__all__ = [
    "Finding",
    "ProposalMethod",
    "SpeculatorsConfig",
    "VerifierRef",
    "load_checkpoint",
    "save_checkpoint",
    "validate_checkpoint",
]
