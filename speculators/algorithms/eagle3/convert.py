"""EAGLE-3's ``speculators convert`` layouts (and P-EAGLE's, an EAGLE-3 body): drafts from other projects' layouts
→ the standard format. The eagle3 unit declares this module as its converter; ``speculators.export.convert`` asks
every unit's converter which layout a source is and hands it over.

Layouts (facts from the producers' code, not copied from it):

* ``eagle3-original`` (SafeAILab/EAGLE ``traineagle3``): a flat Llama ``config.json`` (``architectures:
  ["LlamaForCausalLM"]``, ``model_type: llama``, ``draft_vocab_size``), weights ``midlayer.*``, ``fc``, ``norm``,
  ``lm_head``, ``d2t`` (offsets) and ``t2d``, often as ``pytorch_model.bin``, usually without ``embed_tokens``. The
  residual of layer 0 is the un-normed hidden state (``norm_before_residual: false``); aux states are the inputs
  of layers ``[2, L//2, L-3]`` (vLLM's convention) and the config lists none.
* ``specforge`` (SGLang's trainer): the same flat config with ``architectures: ["LlamaForCausalLMEagle3"]`` and
  optionally ``eagle_config.eagle_aux_hidden_state_layer_ids`` in the OUTPUT-of-layer convention (SGLang adds 1;
  SpecForge's default ``[1, L//2-1, L-4]`` is vLLM's ``[2, L//2, L-3]``); ``model.safetensors`` without
  ``embed_tokens``; ``norm_before_residual: false`` semantics.
* ``speculators``: the standard format itself (EAGLE-3, or speculators 0.9.0's P-EAGLE: the same keys plus
  ``mask_token_id`` and ``embed_requires_grad``, the same tensors plus ``mask_hidden``), possibly older (no ``norm_before_residual``, no layer
  ``model_type``, a top-level ``model_type``, ``model.``-prefixed names, d2t as ids) or newer (``norm_before_fc``,
  ``fc_norm``, ``norm_output``: EAGLE-3.1, what speculators 0.9.0 trains by default, sets the first and the last).
  ``--flags max-compat`` writes the form the most consumers read: keys outside the format dropped, a norm flag the
  draft was not trained with false, one it was kept (with a warning); ``keep`` copies every key.

EAGLE-1/HASS drafts (one layer over ``fc(cat(embedding, feature))`` with ``fc`` [H, 2H], no aux layers; the
speculators ``eagle`` type) are a different architecture that vLLM cannot serve: they get an explanation.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from speculators import algorithms, draft_layer_types

# the module, not its names: it imports speculators.export (this package) itself, so either may be imported first
from speculators.algorithms.eagle3.config import Eagle3Config
from speculators.export.conversion import UnsupportedDraftError, align_rope, shifted_aux_ids, write_converted
from speculators.export.exporter import load_verifier_config
from speculators.export.tensors import warn
from speculators.format.config import (
    LAYER_KEYS_FROM_VERIFIER,
    ProposalMethod,
    SpeculatorsConfig,
    VerifierRef,
)
from speculators.format.validate import Finding

# the layouts this converter reads; asked after the block drafters' (their layers read H features as EAGLE-1's)
LAYOUTS = ("eagle3-original", "specforge", "speculators")
DETECT_ORDER = 1
NEWER_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")
SPECFORGE_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Qwen3ForCausalLMEagle3", "Qwen2ForCausalLMEagle3")
# Flat-config keys copied into transformer_layer_config (the rest of a flat config is producer metadata): the
# layer keys a draft takes from its verifier, less rope (always re-copied from the verifier), plus mlp_bias.
FLAT_LAYER_KEYS = tuple(k for k in LAYER_KEYS_FROM_VERIFIER if not k.startswith("rope_")) + ("mlp_bias",)


EAGLE1_EXPLANATION = (
    "{where} is an EAGLE-1/HASS-style draft ({evidence}). That architecture feeds one decoder layer with "
    "fc(cat(token embedding, last verifier feature)) and reads no auxiliary layers; EAGLE-3 reads three verifier "
    "layers through fc [H, 3H] and attends over cat(embedding, hidden) [2H]. vLLM serves only the eagle3 family "
    "from the speculators format (its loader rejects the 'eagle' type), and no weight mapping turns one into the "
    "other. Nothing was written. To serve HASS-quality drafts, train on the EAGLE-3 architecture (HASS's top-K "
    "distillation and context alignment apply to it) and export that."
)


# ---- detection ---------------------------------------------------------------------------------------------
def detect(config: dict[str, Any], tensors: dict[str, torch.Tensor], where: str = "source") -> str | None:
    """One of :data:`LAYOUTS`, or None for a source that is no EAGLE-3 draft; raises ``UnsupportedDraftError`` for
    EAGLE-1/HASS."""
    check_not_eagle1(config, tensors, where)
    if isinstance(config.get("speculators_config"), dict) or "speculators_model_type" in config:
        return "speculators"
    architectures = config.get("architectures") or []
    if any(a in SPECFORGE_ARCHITECTURES for a in architectures) or isinstance(
        config.get("eagle_config"), dict
    ):
        return "specforge"
    names = {n.removeprefix("model.") for n in tensors}
    if "draft_vocab_size" in config or any(n.startswith("midlayer.") for n in names):
        return "eagle3-original"
    return None


def check_not_eagle1(config: dict[str, Any], tensors: dict[str, torch.Tensor], where: str) -> None:
    evidence = None
    if config.get("speculators_model_type") == "eagle":
        evidence = "speculators_model_type 'eagle'"
    names = {n.removeprefix("model.").replace("midlayer.", "layers.0."): t for n, t in tensors.items()}
    fc, q_proj = names.get("fc.weight"), names.get("layers.0.self_attn.q_proj.weight")
    if evidence is None and fc is not None and fc.ndim == 2 and fc.shape[1] == 2 * fc.shape[0]:
        evidence = f"fc.weight {list(fc.shape)} = [H, 2H]" + (", with fc.bias" if "fc.bias" in names else "")
    if evidence is None and fc is not None and q_proj is not None and q_proj.shape[1] == fc.shape[0]:
        evidence = f"layer 0 q_proj reads {q_proj.shape[1]} features, not 2H = {2 * fc.shape[0]}"
    if evidence:
        raise UnsupportedDraftError(EAGLE1_EXPLANATION.format(where=where, evidence=evidence))


# ---- pieces shared by the layouts --------------------------------------------------------------------------
def layer_from_flat(
    config: dict[str, Any], vocab_size: int, verifier_config: dict[str, Any]
) -> dict[str, Any]:
    """``transformer_layer_config`` from a flat Llama draft config (eagle3-original / SpecForge layouts)."""
    layer = {k: config[k] for k in FLAT_LAYER_KEYS if config.get(k) is not None}
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads") if k not in layer]
    if missing:
        raise ValueError(f"the source config.json lacks {missing}; it cannot describe the draft layer")
    layer["vocab_size"] = vocab_size
    layer.setdefault("num_key_value_heads", layer["num_attention_heads"])
    layer.setdefault("head_dim", layer["hidden_size"] // layer["num_attention_heads"])
    layer.setdefault("hidden_act", "silu")
    layer.setdefault("attention_bias", False)
    layer.setdefault("rms_norm_eps", verifier_config.get("rms_norm_eps", 1e-6))
    layer.setdefault("max_position_embeddings", verifier_config.get("max_position_embeddings", 4096))
    for key in ("rope_theta", "rope_scaling", "rope_parameters"):
        if config.get(key) is not None:
            layer[key] = config[key]
    layer.update(
        model_type="llama",
        num_hidden_layers=int(config.get("num_hidden_layers", 1)),
        tie_word_embeddings=False,
    )
    return layer


def resolve_flags(source: dict[str, Any], mode: str, where: str) -> dict[str, bool]:
    """The optional norm flags to write: the source's, an absent one false. A flag the draft was trained with
    stays on in every mode: its weights depend on it (an RMSNorm cannot be folded into the next linear layer), so
    no form without it exists. ``max-compat`` says so in a warning: vLLM 0.32 and speculators 0.9.0 read the
    flags, a consumer release that predates one ignores it and would draft from other features."""
    flags = {name: bool(source.get(name, False)) for name in NEWER_FLAGS}
    needed = [name for name, value in flags.items() if value]
    if mode == "max-compat" and needed:
        warn(
            f"{where}: kept {needed} true: the draft was trained with them and its weights depend on them "
            "(EAGLE-3.1 sets norm_before_fc and norm_output); vLLM 0.32 and speculators 0.9.0 read them, a "
            "consumer release that predates one ignores it and would draft from other features than trained"
        )
    return flags


def vocab_size_of(
    config: dict[str, Any], tensors: dict[str, torch.Tensor], verifier: dict[str, Any], where: str
) -> int:
    """The verifier vocabulary: t2d's length, else the config's ``vocab_size``; it must equal the verifier's."""
    names = {n.removeprefix("model."): t for n, t in tensors.items()}
    size = (
        int(names["t2d"].numel())
        if "t2d" in names
        else int(config.get("vocab_size") or verifier["vocab_size"])
    )
    if "vocab_size" in verifier and size != int(verifier["vocab_size"]):
        raise ValueError(
            f"{where}: the draft was built for a {size}-token vocabulary but the verifier has {verifier['vocab_size']}; "
            "is --verifier the model this draft was trained for?"
        )
    return size


# ---- the layouts -------------------------------------------------------------------------------------------
def config_from_flat(
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    verifier_config: dict[str, Any],
    aux_convention: str,
    flag_mode: str,
    where: str,
) -> Eagle3Config:
    """eagle3-original and SpecForge: flat Llama config → Eagle3Config."""
    vocab = vocab_size_of(config, tensors, verifier_config, where)
    layer = layer_from_flat(config, vocab, verifier_config)
    eagle_config = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    nested_ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    top_ids = config.get("eagle_aux_hidden_state_layer_ids")
    if aux_convention == "auto":
        # SGLang adds 1 to the ids under eagle_config; top-level ids are read by vLLM as they are.
        aux_convention = "output-of-layer" if nested_ids is not None and top_ids is None else "vllm"
    ids = shifted_aux_ids(
        top_ids if top_ids is not None else nested_ids,
        aux_convention,
        int(verifier_config["num_hidden_layers"]),
        where,
    )
    flags = resolve_flags({**config, **eagle_config}, flag_mode, where)
    target_hidden = config.get("target_hidden_size")
    return Eagle3Config(
        transformer_layer_config=layer,
        speculators_config=SpeculatorsConfig(verifier=VerifierRef(name_or_path="", architectures=[])),
        draft_vocab_size=int(config.get("draft_vocab_size") or vocab),
        eagle_aux_hidden_state_layer_ids=ids,
        norm_before_residual=False,
        target_hidden_size=int(target_hidden)
        if target_hidden and target_hidden != layer["hidden_size"]
        else None,
        **flags,
    )


def config_from_speculators(
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    verifier_config: dict[str, Any],
    aux_convention: str,
    flag_mode: str,
    where: str,
) -> Eagle3Config:
    """An older or newer speculators config of an EAGLE-3-bodied type (``eagle3``, speculators 0.9.0's ``peagle``)
    → today's max-compat (or kept) form in that type's config class, each fix-up warned."""
    config = copy.deepcopy(config)
    if "model_type" in config:
        warn(
            f"{where}: removed the top-level model_type {config.pop('model_type')!r} (vLLM ignores the format with it)"
        )
    spec = config.setdefault("speculators_config", {})
    spec.setdefault("algorithm", "eagle3")
    methods = spec.get("proposal_methods") or [{"proposal_type": "greedy", "speculative_tokens": 3}]
    spec["proposal_methods"] = [
        {k: v for k, v in m.items() if k in ProposalMethod.__dataclass_fields__} for m in methods
    ]
    spec.setdefault("default_proposal_method", spec["proposal_methods"][0].get("proposal_type", "greedy"))
    spec.setdefault("verifier", {})
    spec["verifier"] = {"name_or_path": spec["verifier"].get("name_or_path") or "", "architectures": []}
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(
            f"{where}: speculators config without transformer_layer_config; it cannot be converted"
        )
    if "model_type" not in layer:
        names = {n.removeprefix("model.") for n in tensors}
        layer["model_type"] = draft_layer_types.of_tensors(names).name
        warn(
            f"{where}: transformer_layer_config.model_type was missing (the speculators library would assume qwen3); "
            f"wrote {layer['model_type']!r}, read from the weights"
        )
    if "vocab_size" not in layer:
        layer["vocab_size"] = vocab_size_of({}, tensors, verifier_config, where)
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    config["eagle_aux_hidden_state_layer_ids"] = shifted_aux_ids(
        ids,
        "vllm" if aux_convention == "auto" else aux_convention,
        int(verifier_config["num_hidden_layers"]),
        where,
    )
    for name, value in resolve_flags(config, flag_mode, where).items():
        config[name] = value
    config.setdefault("draft_vocab_size", layer["vocab_size"])
    # the type's own config class (EAGLE-3, or P-EAGLE with its mask token): its keys are kept, not dropped
    parsed = algorithms.of_config(config).config_class.from_dict(config)
    # a type with a mask token says where its id came from
    if getattr(parsed, "mask_token_source", None) == "":
        parsed.mask_token_source = "the source's mask_token_id (speculators layout)"
    if flag_mode == "max-compat":
        dropped = sorted(parsed.extra)
        if dropped:
            warn(f"{where}: max-compat form: dropped config keys outside the format {dropped}")
        parsed.extra = {}
    return parsed


# ---- the entry point -------------------------------------------------------------------------------------------
def convert(
    src: Path,
    out_dir: str | Path,
    layout: str,
    source_config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    verifier: str | None,
    verifier_ref: str,
    verifier_name: str | None,
    source_verifier: str | None,
    aux_convention: str,
    flags: str,
    norm_before_residual: bool | None,
    speculative_tokens: int | None,
    dtype: str,
    model_card: bool,
) -> tuple[dict[str, Any], list[Finding]]:
    """Convert one EAGLE-3-bodied source (already read and detected as ``layout``) into a validated standard
    directory (``speculators.export.convert.convert_checkpoint`` documents the arguments)."""
    where = str(src)
    verifier_path, verifier_config = load_verifier_config(str(verifier_ref))
    if layout == "speculators":
        config = config_from_speculators(
            source_config, tensors, verifier_config, aux_convention, flags, where
        )
        if norm_before_residual is None and "norm_before_residual" not in source_config:
            raise ValueError(
                f"{where}: norm_before_residual is missing and the consumers disagree on its default (vLLM: true, "
                "the speculators library: false); pass --norm-before-residual true|false as the draft was trained"
            )
    else:
        config = config_from_flat(source_config, tensors, verifier_config, aux_convention, flags, where)
    if norm_before_residual is not None:
        config.norm_before_residual = bool(norm_before_residual)
    align_rope(config.transformer_layer_config, verifier_config, where)
    written_name = verifier_name or (verifier_path if verifier else source_verifier) or verifier_path
    config.speculators_config.verifier = VerifierRef(
        name_or_path=str(written_name), architectures=list(verifier_config.get("architectures") or [])
    )
    return write_converted(
        config, tensors, src, out_dir, layout, verifier_ref, verifier_path, verifier_config,
        speculative_tokens, dtype, model_card,
    )  # fmt: skip
