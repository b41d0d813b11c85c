"""Typed ``config.json`` of a DFlash2 draft: DFlash's (speculators.algorithms.dflash.config) plus the keys of its
local dynamic convolutions and its candidate selector, with speculators 0.9.0's defaults.

DFlash2 reads the full verifier vocabulary: its selector keeps a predecessor and a successor code per verifier token
and scores the unary head's top-k verifier ids, so speculators 0.9.0 refuses a reduced draft vocabulary and so do
we (``FULL_VOCABULARY``: :meth:`DFlashConfig.full_vocabulary_problem`, checked by the config's construction, the
model and the validator)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from speculators.algorithms.dflash.config import DFlashConfig


@dataclass
class DFlash2Config(DFlashConfig):
    """config.json of a DFlash2 draft (``speculators_model_type: dflash2``)."""

    SPECULATORS_MODEL_TYPE: ClassVar[str] = "dflash2"
    ARCHITECTURE: ClassVar[str] = "DFlash2Speculator"
    FULL_VOCABULARY: ClassVar[tuple[str, str] | None] = (
        "DFlash2",
        "its selector scores verifier ids; speculators 0.9.0 refuses a reduced one too",
    )
    sliding_window_non_causal: bool = True  # 0.9.0's default for dflash2 (a bidirectional block)
    conv_kernel_size: int = 2  # causal taps of each local dynamic convolution (slot s reads slots s-t+1..s)
    conv_group_size: int = 16  # hidden channels sharing one dynamic kernel coefficient
    selector_rank: int = 256  # rank of the candidate selector's predecessor/hidden/successor product
    selector_top_k: int = 16  # unary candidates the selector reranks per slot


__all__ = ["DFlash2Config"]
