"""Typed ``config.json`` of an EAGLE-3 draft (the shared keys and helpers are speculators.format.config).

The field names and defaults follow what vLLM and the ``speculators`` library read (see docs/format.md). Where the two
consumers disagree on a default (``norm_before_residual``, ``transformer_layer_config.model_type``), we always write
the value explicitly so neither has to guess.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from speculators import __version__, families
from speculators.format.config import (
    SLIDING,
    DraftConfig,
    ProposalMethod,
    SpeculatorsConfig,
    VerifierRef,
    draft_layer_config,
)

DRAFT_ARCHITECTURE = "Eagle3Speculator"


@dataclass
class Eagle3Config(DraftConfig):
    """config.json of an EAGLE-3 draft in the speculators format.

    ``transformer_layer_config`` is a plain HF decoder-layer config dict (``model_type`` llama or qwen3) whose
    ``vocab_size`` is the VERIFIER's vocabulary; ``draft_vocab_size`` is the size of the draft's lm_head.
    """

    SPECULATORS_MODEL_TYPE: ClassVar[str] = "eagle3"
    ARCHITECTURE: ClassVar[str] = DRAFT_ARCHITECTURE
    transformer_layer_config: dict[str, Any]
    speculators_config: SpeculatorsConfig
    draft_vocab_size: int
    eagle_aux_hidden_state_layer_ids: list[int]
    norm_before_residual: bool = True
    target_hidden_size: int | None = None
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    torch_dtype: str = "bfloat16"
    speculators_version: str = __version__
    # Keys we do not model (newer optional flags, producer metadata) survive a load/save round trip untouched.
    extra: dict[str, Any] = field(default_factory=dict)

    # ---- construction --------------------------------------------------------------------------------------
    @classmethod
    def from_verifier(
        cls,
        verifier_config: dict[str, Any],
        name_or_path: str,
        draft_vocab_size: int | None = None,
        aux_layer_ids: list[int] | None = None,
        speculative_tokens: int = 3,
        num_layers: int = 1,
        layer_type: str | None = None,
        norm_before_residual: bool = True,
        torch_dtype: str = "bfloat16",
        sliding_window: int | None = None,
    ) -> Eagle3Config:
        """A draft config whose layer shape, heads and rope are copied from the verifier's HF config dict.

        Aux ids default to ``[2, L//2, L-3]`` in vLLM's convention (the residual stream *entering* layer k).
        ``sliding_window``: every draft layer attends over that many positions (long-context drafts), written as
        ``layer_types`` / ``sliding_window`` in ``transformer_layer_config``, the keys vLLM reads.
        """
        family = families.of_config(verifier_config)
        if aux_layer_ids is None:
            aux_layer_ids = family.default_aux_layer_ids(verifier_config)
        layer_type = layer_type or family.draft_layer_type
        layer = draft_layer_config(verifier_config, layer_type, num_layers)
        if sliding_window is not None:
            layer.update(window_layout(sliding_window, num_layers))
        architectures = list(verifier_config.get("architectures") or ["LlamaForCausalLM"])
        return cls(
            transformer_layer_config=layer,
            speculators_config=SpeculatorsConfig(
                verifier=VerifierRef(name_or_path=str(name_or_path), architectures=architectures),
                proposal_methods=[ProposalMethod(speculative_tokens=speculative_tokens)],
            ),
            draft_vocab_size=int(draft_vocab_size or layer["vocab_size"]),
            eagle_aux_hidden_state_layer_ids=[int(i) for i in aux_layer_ids],
            norm_before_residual=norm_before_residual,
            torch_dtype=torch_dtype,
        )


def window_layout(window: int, num_layers: int) -> dict[str, Any]:
    """The ``transformer_layer_config`` keys of an all-sliding EAGLE-3 draft (vLLM reads ``layer_types`` per draft
    layer and ``sliding_window``; ``use_sliding_window`` is what transformers' Qwen configs gate windows on)."""
    if int(window) < 1:
        raise ValueError(f"sliding_window {window}: a window holds at least the query's own position")
    return {
        "layer_types": [SLIDING] * int(num_layers),
        "sliding_window": int(window),
        "use_sliding_window": True,
    }
