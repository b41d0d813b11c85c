"""The decoder-layer types a draft can be built from, declared once.

vLLM's speculators loader picks the draft's model class from ``transformer_layer_config.model_type`` and knows two:
``llama`` → ``Eagle3LlamaForCausalLM`` and ``qwen3`` → ``Eagle3Qwen3ForCausalLM`` (block drafters are always
built as Qwen3 layers). The two differ only by Qwen3's per-head q/k RMSNorm before rotary; the rope settings are
copied from the verifier alike for both (``speculators.format.config.rope_settings``). The verifier families (which
type vLLM builds for a verifier), the recipe settings, the config builder, the draft model, the validator and the
converter all read this module, so a third type is one more entry here.

This module imports nothing from the package: every layer may depend on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class DraftLayerType:
    """One decoder-layer type vLLM builds a draft from."""

    name: str  # transformer_layer_config.model_type
    vllm_class: str  # the class vLLM's speculators loader maps it to (EAGLE-3 drafts)
    qk_norm: bool  # per-head RMSNorm on q and k before rotary (``self_attn.q_norm`` / ``k_norm``)

    @property
    def marker_tensors(self) -> frozenset[str]:
        """Tensors that only this type's first layer holds: how a foreign checkpoint's layer type is told apart."""
        return frozenset({"layers.0.self_attn.q_norm.weight"}) if self.qk_norm else frozenset()


LLAMA = DraftLayerType(name="llama", vllm_class="Eagle3LlamaForCausalLM", qk_norm=False)
QWEN3 = DraftLayerType(name="qwen3", vllm_class="Eagle3Qwen3ForCausalLM", qk_norm=True)
BLOCK_DRAFTER = (
    QWEN3  # vLLM builds every block drafter (DFlash, DSpark) as Qwen3 layers, whatever the verifier
)

_TYPES: dict[str, DraftLayerType] = {t.name: t for t in (LLAMA, QWEN3)}


def names() -> tuple[str, ...]:
    """Every ``transformer_layer_config.model_type`` vLLM builds a draft from."""
    return tuple(_TYPES)


def get(name: str) -> DraftLayerType:
    """The layer type of a ``transformer_layer_config.model_type``; a clear error for one vLLM does not build."""
    if name not in _TYPES:
        raise ValueError(f"draft layer type {name!r} is not one vLLM builds: one of {names()}")
    return _TYPES[name]


def is_known(name: object) -> bool:
    return isinstance(name, str) and name in _TYPES


def has_qk_norm(name: object) -> bool:
    """Whether a layer of this ``model_type`` holds q/k norms (False for one vLLM does not build)."""
    return is_known(name) and _TYPES[str(name)].qk_norm


def of_tensors(tensor_names: Iterable[str]) -> DraftLayerType:
    """The layer type a checkpoint's tensors are laid out as (for foreign checkpoints whose config does not say):
    the type whose marker tensors are all present, else the one without markers."""
    present = set(tensor_names)
    marked = [t for t in _TYPES.values() if t.marker_tensors and t.marker_tensors <= present]
    return marked[0] if marked else next(t for t in _TYPES.values() if not t.marker_tensors)
