"""The speculative decoding engine: drafting (chain, tree), verification (greedy, lossless rejection sampling),
KV caches with per-row acceptance, metrics, and the plain decoding baseline it is compared against."""

from speculators.decoding.engine import (
    DecodingConfig,
    GenerationResult,
    SpeculativeDecoder,
    eos_ids,
    plain_generate,
)
from speculators.decoding.metrics import DecodingStats
from speculators.decoding.verify import RejectionSampler

__all__ = [
    "DecodingConfig",
    "DecodingStats",
    "GenerationResult",
    "RejectionSampler",
    "SpeculativeDecoder",
    "eos_ids",
    "plain_generate",
]
