"""Typed ``config.json`` of an MTP draft: the multi-token-prediction layer a Qwen3-Next / Qwen3.5 verifier ships,
fine-tuned, written as speculators 0.9.0 writes it (``speculators_model_type: mtp``).

``transformer_layer_config`` is the verifier's own text config (``model_type`` ``qwen3_next``, ``qwen3_5_text`` or
``qwen3_5_moe_text``): the MTP layer is one of the verifier's full-attention decoder layers (its attention, its MLP
or MoE block) with the MTP input projection and norms around it, so every shape comes from that config.
``num_nextn_predict_layers`` is how many MTP layers the checkpoint holds (vLLM reads it; 0.9.0 supports 1). The
draft predicts over the verifier's whole vocabulary with the verifier's own embedding and ``lm_head`` (neither is
stored: both consumers take the verifier's).

``mtp_hidden_state_layer_ids`` is ``[L]``: MTP reads the verifier's last hidden state (the stream leaving the last
layer, which the model puts through the verifier's final norm, as vLLM hands the MTP module the target's normed
output). It is our key (the aux-layer key every unit declares); the consumers ignore it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from speculators import __version__, families
from speculators.format.config import DraftConfig, ProposalMethod, SpeculatorsConfig, VerifierRef

ARCHITECTURE = "MTPDraftModel"  # what speculators 0.9.0 writes and loads by
MTP_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# keys of the verifier's config that say nothing about the MTP layer (and would make a consumer build a full model)
_DROPPED_KEYS = ("architectures", "auto_map", "transformers_version", "_name_or_path", "torch_dtype", "dtype")


@dataclass
class MTPConfig(DraftConfig):
    """config.json of an MTP draft (see the module docstring)."""

    SPECULATORS_MODEL_TYPE: ClassVar[str] = "mtp"
    ARCHITECTURE: ClassVar[str] = ARCHITECTURE
    transformer_layer_config: dict[str, Any]
    speculators_config: SpeculatorsConfig
    # absent from speculators 0.9.0's own configs: then the verifier's layer count, as that package reads it
    mtp_hidden_state_layer_ids: list[int] | None = None
    num_nextn_predict_layers: int = 1
    target_hidden_size: int | None = None
    torch_dtype: str = "bfloat16"
    speculators_version: str = __version__
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_verifier(
        cls,
        verifier_config: dict[str, Any],
        name_or_path: str,
        speculative_tokens: int = 3,
        torch_dtype: str = "bfloat16",
    ) -> MTPConfig:
        """The MTP config of a verifier with MTP layers (its text config, its layer count as the hidden id)."""
        text = families.flat_config(verifier_config)
        if text.get("model_type") not in MTP_MODEL_TYPES:
            raise ValueError(
                f"MTP fine-tunes the MTP layers a verifier ships; model_type {text.get('model_type')!r} ships none "
                f"that speculators 0.9.0 and vLLM read (one of {', '.join(MTP_MODEL_TYPES)})"
            )
        layer = {k: v for k, v in text.items() if k not in _DROPPED_KEYS}
        architectures = list(verifier_config.get("architectures") or [])
        return cls(
            transformer_layer_config=layer,
            speculators_config=SpeculatorsConfig(
                verifier=VerifierRef(name_or_path=str(name_or_path), architectures=architectures),
                algorithm="mtp",
                proposal_methods=[ProposalMethod(speculative_tokens=speculative_tokens)],
            ),
            mtp_hidden_state_layer_ids=[int(text["num_hidden_layers"])],
            torch_dtype=torch_dtype,
        )

    def __post_init__(self) -> None:
        if self.mtp_hidden_state_layer_ids is None:
            layers = self.transformer_layer_config.get("num_hidden_layers")
            if layers is None:  # a diff dict leaves out what equals its config class's default
                from transformers import AutoConfig

                layers = AutoConfig.for_model(self.transformer_layer_config["model_type"]).num_hidden_layers
            self.mtp_hidden_state_layer_ids = [int(layers)]

    # ---- derived views (what the engine's drafter and the exporter read) ------------------------------------
    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_size  # the verifier's whole vocabulary (0.9.0 refuses a reduced one)

    @property
    def num_layers(self) -> int:
        return int(self.num_nextn_predict_layers)  # draft layers (the verifier's count is the layer config's)

    @property
    def layer_type(self) -> str:
        return str(self.transformer_layer_config["model_type"])

    @property
    def layer_windows(self) -> list[int | None]:
        return [None] * self.num_layers  # the MTP layer is a full-attention layer

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self.mtp_hidden_state_layer_ids)
