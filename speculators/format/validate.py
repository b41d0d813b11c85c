"""The validator: every rule vLLM and the ``speculators`` library enforce on a checkpoint (docs/format.md). The keys
every type shares are checked here; a type's own keys, tensor shapes and weight checks come from its algorithm unit
(``speculators.algorithms``: EAGLE-3's, DFlash's).

Each rule yields one ``Finding`` that names the file, what is wrong, and the fix. ``error`` findings make a
checkpoint unservable by at least one consumer; ``warning`` findings are legal but surprising.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from speculators import draft_layer_types, families
from speculators.format.checkpoint import load_tensors, missing_config_hint, weight_files
from speculators.format.config import verifier_name_or_path
from speculators.local_paths import is_hub_id, names_local_path

# types vLLM serves that no unit of this project declares (none today: dflash2, the last one, is a unit): their
# shared keys are checked, their own keys and tensors are not (a warning says so)
UNDECLARED_SERVABLE_TYPES: tuple[str, ...] = ()
REQUIRED_LAYER_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "max_position_embeddings",
)


# Keys only a draft's config.json has (speculators format, or the EAGLE-3 / SpecForge layouts convert reads).
DRAFT_CONFIG_KEYS = (
    "speculators_config",
    "speculators_model_type",
    "draft_vocab_size",
    "eagle_config",
    "eagle_aux_hidden_state_layer_ids",
)

# The dtypes both consumers load a draft's weights in (vLLM casts a bf16/fp16/fp32 draft to the serving dtype);
# an integer (quantized) or float64 weight is read as raw numbers or refused.
LOADABLE_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Index tensors, not weights: their own dtypes (int64 offsets, bool mask) are checked by ``_vocab_findings``.
INDEX_TENSORS = ("d2t", "t2d")
DTYPES_BY_NAME = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


@dataclass(frozen=True)
class Finding:
    severity: str  # "error" | "warning"
    file: str
    message: str

    def __str__(self) -> str:
        return f"{self.severity.upper():7s} {self.file}: {self.message}"


def validate_checkpoint(
    directory: str | Path, verifier_config: dict[str, Any] | None = None, check_weights: bool = True
) -> list[Finding]:
    """All findings for a checkpoint directory. ``verifier_config`` (an HF config dict) enables the cross-checks
    against the verifier; when omitted it is read from ``verifier.name_or_path`` if that is a local directory."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.exists():
        hint = missing_config_hint(directory)
        return [Finding("error", str(config_path), f"missing; {hint}")]
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        return [Finding("error", str(config_path), f"is not valid JSON ({exc}); rewrite it")]
    if (not_draft := model_not_draft(config)) is not None:
        return [Finding("error", str(config_path), not_draft)]  # its weights (16 GB for 8B) are never read
    findings = list(_config_findings(config, str(config_path)))
    if verifier_config is None:
        verifier_config, not_run = verifier_config_or_reason(config)
        if not_run is not None:
            findings.append(Finding("warning", str(config_path), f"verifier checks not run: {not_run}"))
    if verifier_config is not None:
        findings += list(_verifier_findings(config, verifier_config, str(config_path)))
    if check_weights and not any(
        f.severity == "error" and "transformer_layer_config" in f.message for f in findings
    ):
        findings += list(_weight_findings(config, directory))
    return findings


def model_not_draft(config: Any) -> str | None:
    """Why a ``config.json`` is a model's (a verifier's: HF ``model_type``, no ``speculators_config``) rather than
    a draft's, or None. Said first and alone, because every other finding about a model would be noise and
    reading its weights would take minutes for nothing."""
    if not isinstance(config, dict) or any(key in config for key in DRAFT_CONFIG_KEYS):
        return None
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or any("eagle" in str(a).lower() for a in architectures):
        return None  # a draft in another layout (original EAGLE-3, SpecForge): `speculators convert` reads it
    if "model_type" not in config and not architectures:
        return None
    kind = config.get("model_type") or ", ".join(config.get("architectures") or [])
    return (
        f"this is a model ({kind}), not a speculators draft: it has no speculators_config. Give the draft "
        "directory (e.g. the output of `speculators export`) and name this model with --verifier"
    )


def errors(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == "error"]


# ---- config.json -------------------------------------------------------------------------------------------
def _config_findings(config: dict[str, Any], where: str) -> Iterator[Finding]:
    def error(message: str) -> Finding:
        return Finding("error", where, message)

    def warning(message: str) -> Finding:
        return Finding("warning", where, message)

    if "model_type" in config:
        yield error(
            f"has a top-level model_type ({config['model_type']!r}): vLLM will not recognise the speculators "
            "format; remove it (the layer type belongs in transformer_layer_config.model_type)"
        )
    model_type = config.get("speculators_model_type")
    if model_type is None:
        yield error('speculators_model_type is missing; set it to "eagle3"')
    elif model_type not in servable_model_types():
        yield error(
            f"speculators_model_type {model_type!r} is not servable by vLLM (one of {servable_model_types()}); "
            "an EAGLE-1/HASS-style draft must be converted to the eagle3 architecture"
        )
    yield from _architecture_findings(config, warning)
    yield from _speculators_config_findings(config.get("speculators_config"), error)

    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        yield error(
            "transformer_layer_config is missing or not a dict; copy the verifier's layer settings into it"
        )
    else:
        unit = algorithm_of(config)
        own_layer = unit is not None and unit.verifier_layer_config
        layer_type = layer.get("model_type")
        if own_layer:
            pass  # the verifier's own config: the unit's rules check its model_type
        elif layer_type is None:
            yield error(
                "transformer_layer_config.model_type is missing: vLLM needs it and the speculators library "
                f"assumes qwen3; write one of {draft_layer_types.names()}"
            )
        elif not draft_layer_types.is_known(layer_type):
            yield error(
                f"transformer_layer_config.model_type {layer_type!r} is not one of {draft_layer_types.names()}"
            )
        for key in REQUIRED_LAYER_KEYS:
            if key not in layer:
                yield error(f"transformer_layer_config.{key} is missing; copy it from the verifier's config")
        if "rope_theta" not in layer and "rope_parameters" not in layer:
            yield warning("transformer_layer_config has no rope_theta; copy the verifier's rope settings")
        draft_vocab = config.get("draft_vocab_size")
        if own_layer and draft_vocab is None:
            pass  # the verifier's whole vocabulary, no key (what the unit's consumers read)
        elif not isinstance(draft_vocab, int) or draft_vocab <= 0:
            yield error("draft_vocab_size is missing or not a positive integer")
        elif isinstance(layer.get("vocab_size"), int) and draft_vocab > layer["vocab_size"]:
            yield error(
                f"draft_vocab_size {draft_vocab} exceeds transformer_layer_config.vocab_size {layer['vocab_size']}"
                "; vocab_size must be the verifier's full vocabulary"
            )
        target_hidden = config.get("target_hidden_size")
        if target_hidden not in (None, layer.get("hidden_size")):
            yield warning(
                f"target_hidden_size {target_hidden} differs from hidden_size {layer.get('hidden_size')}: the "
                "speculators library ignores target_hidden_size; keep the draft as wide as the verifier"
            )
    yield from _type_findings(config, error, warning)


def algorithm_of(config: dict[str, Any]) -> Any:
    """The declared unit (``speculators.algorithms``) of a config's type, or None for a type vLLM serves but this
    project declares no unit for (its own keys then go unchecked, with a warning)."""
    from speculators import algorithms

    try:
        return algorithms.of_config(config)
    except ValueError:
        return None


def servable_model_types() -> tuple[str, ...]:
    """The ``speculators_model_type`` values vLLM serves: every declared unit's, and the undeclared ones above."""
    from speculators import algorithms

    return (*algorithms.names(), *(t for t in UNDECLARED_SERVABLE_TYPES if t not in algorithms.names()))


def _architecture_findings(config: dict[str, Any], warning) -> Iterator[Finding]:
    """A warning when ``architectures`` holds none of the strings the type's unit accepts (ours and the speculators
    package's: both consumers load by ``speculators_model_type``, so this is a surprise, not an error). A type
    without a unit has no known strings: nothing is said (``_type_findings`` warns it went unchecked)."""
    unit = algorithm_of(config)
    if unit is None:
        return
    written = config.get("architectures") or []
    if not isinstance(written, list) or not any(a in unit.architectures for a in written):
        accepted = " or ".join(f'["{a}"]' for a in unit.architectures)
        yield warning(
            f"architectures is {written!r}, expected {accepted} for speculators_model_type {unit.name!r}; "
            "consumers load by speculators_model_type, but other tools read this key: write one of these"
        )


def _type_findings(config: dict[str, Any], error, warning) -> Iterator[Finding]:
    """The rules of the type's own keys, from its unit: each algorithm declares them, none is special-cased here."""
    unit = algorithm_of(config)
    if unit is None:
        if config.get("speculators_model_type") in servable_model_types():
            yield warning(
                f"speculators_model_type {config['speculators_model_type']!r} has no declared unit in this project: "
                "only the keys every type shares were checked (not its own keys or tensor shapes)"
            )
        return
    for message in unit.config_rules(config):
        yield error(message)
    for message in unit.config_warnings(config):
        yield warning(message)


def _speculators_config_findings(spec: Any, error) -> Iterator[Finding]:
    if not isinstance(spec, dict):
        yield error("speculators_config is missing or not a dict; vLLM detects the format by it")
        return
    if not spec.get("algorithm"):
        yield error(
            'speculators_config.algorithm is missing (the speculators library needs it); set "eagle3"'
        )
    methods = spec.get("proposal_methods")
    if not isinstance(methods, list) or not methods:
        yield error("speculators_config.proposal_methods is missing or empty; add a greedy method")
        return
    types = []
    for i, method in enumerate(methods):
        if not isinstance(method, dict) or "proposal_type" not in method:
            yield error(f"speculators_config.proposal_methods[{i}].proposal_type is missing")
        else:
            types.append(method["proposal_type"])
    tokens = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
    if not isinstance(tokens, int) or tokens < 1:
        yield error(
            "speculators_config.proposal_methods[0].speculative_tokens is missing or < 1: vLLM reads "
            "num_speculative_tokens from it"
        )
    default = spec.get("default_proposal_method")
    if default is None:
        yield error(
            "speculators_config.default_proposal_method is missing (the speculators library needs it)"
        )
    elif default not in types:
        yield error(
            f"speculators_config.default_proposal_method {default!r} is not one of the proposal types {types}"
        )
    verifier = spec.get("verifier")
    if not isinstance(verifier, dict):
        yield error("speculators_config.verifier is missing; name the verifier (name_or_path, architectures)")
        return
    if not verifier.get("name_or_path"):
        yield error(
            "speculators_config.verifier.name_or_path is missing: `vllm serve <draft dir>` loads the verifier "
            "model and tokenizer from it"
        )
    if not verifier.get("architectures"):
        yield error("speculators_config.verifier.architectures is missing (the speculators library needs it)")


# ---- against the verifier ----------------------------------------------------------------------------------
def verifier_config_or_reason(config: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """``(the verifier's config, None)`` read from ``verifier.name_or_path`` (a local directory, or a hub id in the
    local cache), or ``(None, why it could not be read and the fix)``: skipping the cross-checks silently would
    pass a draft whose vocabulary or aux ids no verifier accepts as if it had been checked against one."""
    name = verifier_name_or_path(config)
    if name is None:
        return None, "speculators_config.verifier.name_or_path names no verifier; pass --verifier DIR"
    path = Path(os.path.expanduser(name))
    if path.is_dir():
        return _verifier_dir_config(name, path)
    if path.exists():
        return None, f"{name} is a file, not a model directory; pass --verifier DIR"
    if names_local_path(name):
        relative = (
            "" if path.is_absolute() else " (a relative name_or_path is looked up from the current directory)"
        )
        return None, f"{name} does not exist; pass --verifier DIR{relative}"
    cached = cached_hub_config(name)
    if cached is None:
        return None, (
            f"{name} is a hub id not in the local Hugging Face cache (validate never downloads); pass --verifier DIR "
            "to check vocab_size, hidden_size, aux layer ids and rope against it"
        )
    return cached, None


def _verifier_dir_config(name: str, path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """A local verifier directory's config, or why not (a directory without a readable config.json)."""
    config_path = path / "config.json"
    if not config_path.is_file():
        return None, f"{name} has no config.json; pass --verifier DIR (the verifier's HF directory)"
    try:
        return json.loads(config_path.read_text()), None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"{config_path} is not readable JSON ({exc}); pass --verifier DIR"


def cached_hub_config(name: Any) -> dict[str, Any] | None:
    """The ``config.json`` of the hub id ``name`` when the local Hugging Face cache already holds it, else None.
    Never downloads: the validator runs offline, and a hub-id verifier would otherwise escape the checks that need
    its layer count (aux ids above L, which vLLM never captures)."""
    if not isinstance(name, str) or not is_hub_id(name):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json", cache_dir=os.environ.get("HF_HUB_CACHE"))
    except Exception:  # an id the hub library refuses, or no hub library: nothing cached to read
        return None
    if not isinstance(cached, str) or not Path(cached).is_file():
        return None
    try:
        return json.loads(Path(cached).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _verifier_findings(config: dict[str, Any], verifier: dict[str, Any], where: str) -> Iterator[Finding]:
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        return
    family = families.of_config(verifier)
    verifier = family.layer_source(
        verifier
    )  # a wrapper's text_config (Gemma 4, Mistral 3), read via its family
    yield from _family_findings(config, layer, family, where)
    if "vocab_size" in verifier and layer.get("vocab_size") != verifier["vocab_size"]:
        yield Finding(
            "error",
            where,
            f"transformer_layer_config.vocab_size {layer.get('vocab_size')} != the verifier's vocab_size "
            f"{verifier['vocab_size']}: it must be the verifier's full vocabulary (embed_tokens is built from it)",
        )
    if "hidden_size" in verifier and layer.get("hidden_size") != verifier["hidden_size"]:
        yield Finding(
            "error",
            where,
            f"hidden_size {layer.get('hidden_size')} != the verifier's {verifier['hidden_size']}; "
            "the draft must be as wide as the verifier",
        )
    num_layers = verifier.get("num_hidden_layers")
    unit = algorithm_of(config)
    aux_key = unit.aux_layer_key if unit is not None else "eagle_aux_hidden_state_layer_ids"
    ids = config.get(aux_key)
    if isinstance(num_layers, int) and isinstance(ids, list):
        bad = [i for i in ids if not isinstance(i, int) or not 0 <= i <= num_layers]
        if bad:
            yield Finding(
                "error",
                where,
                f"{aux_key} {bad} are outside [0, {num_layers}] for a {num_layers}-layer "
                "verifier (id k = the residual stream entering layer k; id L = the last pre-norm state)",
            )
    verifier_scaling = verifier.get("rope_scaling") or (verifier.get("rope_parameters") or {})
    if verifier_scaling.get("rope_type", "default") not in ("default", None) and not (
        layer.get("rope_scaling") or layer.get("rope_parameters")
    ):
        yield Finding(
            "error",
            where,
            "the verifier uses rope scaling but transformer_layer_config has none; copy the verifier's rope_scaling",
        )


def _family_findings(
    config: dict[str, Any], layer: dict[str, Any], family: families.Family, where: str
) -> Iterator[Finding]:
    """What the verifier's family says about this draft: an undeclared family is read Llama-style (said, so a
    wrong layout shows up as a warning, not as silently wrong features)."""
    if not family.declared:
        yield Finding(
            "warning",
            where,
            f"the verifier's model_type {family.model_type!r} has no declared family (speculators/families/): "
            "its decoder stack is assumed at model.model.layers and its final norm at model.model.norm",
        )


# ---- weights -----------------------------------------------------------------------------------------------
def decoder_layer_shapes(
    layer: dict[str, Any], prefix: str, width: int, qk_norm: bool
) -> dict[str, tuple[int, ...]]:
    """One draft decoder layer's tensors (every draft type's): q/k/v read ``width`` features, per-head q/k norms
    when ``qk_norm`` (:mod:`speculators.draft_layer_types`), biases when ``attention_bias``."""
    hidden, heads = layer["hidden_size"], layer["num_attention_heads"]
    kv_heads = layer.get("num_key_value_heads", heads)
    head_dim = layer.get("head_dim") or hidden // heads
    inter = layer["intermediate_size"]
    p = prefix
    shapes: dict[str, tuple[int, ...]] = {
        p + "self_attn.q_proj.weight": (heads * head_dim, width),
        p + "self_attn.k_proj.weight": (kv_heads * head_dim, width),
        p + "self_attn.v_proj.weight": (kv_heads * head_dim, width),
        p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
        p + "input_layernorm.weight": (hidden,),
        p + "post_attention_layernorm.weight": (hidden,),
        p + "mlp.gate_proj.weight": (inter, hidden),
        p + "mlp.up_proj.weight": (inter, hidden),
        p + "mlp.down_proj.weight": (hidden, inter),
    }
    if qk_norm:
        shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
        shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
    if layer.get("attention_bias"):
        for proj, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
            shapes[p + f"self_attn.{proj}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.bias"] = (hidden,)
    return shapes


def vocab_map_shapes(draft_vocab: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """d2t and t2d, written only when the draft vocabulary is reduced."""
    return {"d2t": (draft_vocab,), "t2d": (vocab,)} if draft_vocab != vocab else {}


def _weight_findings(config: dict[str, Any], directory: Path) -> Iterator[Finding]:
    try:
        where = ", ".join(p.name for p in weight_files(directory))
        tensors = load_tensors(directory)
    except (FileNotFoundError, OSError, ValueError) as exc:  # a damaged file: named by open_weights
        yield Finding("error", str(directory), f"cannot read the weights: {exc}")
        return
    yield from _dtype_findings(config, tensors, where)
    unit = algorithm_of(config)
    if unit is None:
        return  # a type without a declared unit: its tensors are unknown here (warned about with the config)
    try:
        shapes = unit.expected_shapes(config)
    except (KeyError, TypeError) as exc:
        yield Finding("error", "config.json", f"cannot derive tensor shapes: missing {exc}")
        return

    def error(message: str) -> Finding:
        return Finding("error", where, message)

    prefixed = [n for n in tensors if n.startswith("model.")]
    if prefixed:
        yield error(
            f"{len(prefixed)} tensor names carry a 'model.' prefix (e.g. {prefixed[0]!r}): vLLM fails with "
            "\"There is no module or parameter named 'model'\"; store names unprefixed (strip 'model.')"
        )
    names = {n.removeprefix("model.") for n in tensors}
    legacy = {n for n in names if n.startswith("midlayer.")}
    if legacy:
        yield Finding(
            "warning",
            where,
            "uses the original EAGLE-3 'midlayer.' names; run `speculators convert` for 'layers.0.'",
        )
        names = (names - legacy) | {"layers.0." + n.removeprefix("midlayer.") for n in legacy}
    normalized = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("model.")
        name = "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name
        normalized[name] = tensor
    if "embed_tokens.weight" not in normalized and not unit.embed_from_verifier:
        yield error(
            "embed_tokens.weight is missing: the speculators library then loads uninitialised memory; "
            "write a copy of the verifier's embedding"
        )
    for name, shape in shapes.items():
        if name == "embed_tokens.weight":
            pass
        elif name not in normalized:
            yield error(f"{name} is missing (expected shape {list(shape)})")
            continue
        if name in normalized and tuple(normalized[name].shape) != shape:
            yield error(f"{name} has shape {list(normalized[name].shape)}, the config implies {list(shape)}")
    for name in sorted(set(normalized) - set(shapes)):
        yield Finding(
            "warning", where, f"{name} is not part of the format; consumers will ignore or reject it"
        )
    for name, tensor in normalized.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor.float()).all():
            yield error(f"{name} contains NaN or Inf values; the training diverged or the file is corrupted")
    yield from _vocab_findings(config, normalized, error)
    for message in unit.weight_warnings(config, normalized, _local_verifier_dir(config)):
        yield Finding("warning", where, message)


def _local_verifier_dir(config: dict[str, Any]) -> str | None:
    """``verifier.name_or_path`` when it is a local model directory (its weights can then be compared)."""
    name = verifier_name_or_path(config)
    return name if name and (Path(os.path.expanduser(name)) / "config.json").is_file() else None


def _dtype_findings(
    config: dict[str, Any], tensors: dict[str, torch.Tensor], where: str
) -> Iterator[Finding]:
    """Weights must be in a float dtype drafts are served in: vLLM's loader copies any tensor into its parameters
    without a word (``param.data.copy_``), so int8 weights (quantized, or a broken export) serve as raw integers and
    float64 passes as if fine. A served dtype other than config.json's ``torch_dtype`` loads (it is cast) but the
    config misdescribes the file: a warning. Index tensors (d2t, t2d) keep their own dtypes."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, tensor in tensors.items():
        if name.removeprefix("model.") not in INDEX_TENSORS:
            by_dtype.setdefault(tensor.dtype, []).append(name)
    declared = declared_dtype(config)
    declared_name = str(declared).removeprefix("torch.")
    for dtype, names in sorted(by_dtype.items(), key=lambda item: str(item[0])):
        stored = str(dtype).removeprefix("torch.")
        if dtype not in LOADABLE_WEIGHT_DTYPES:
            yield Finding(
                "error",
                where,
                f"{_some(names)} {'has' if len(names) == 1 else 'have'} dtype {stored}, not one drafts are served in "
                "(bfloat16/float16/float32): vLLM copies it into its parameters without a word (integers as raw "
                "values); re-export with `speculators export --dtype bfloat16`",
            )
        elif declared is not None and dtype != declared:
            yield Finding(
                "warning",
                where,
                f"{_some(names)} {'is' if len(names) == 1 else 'are'} stored as {stored} but config.json torch_dtype "
                f"says {declared_name}: consumers cast, but the config misdescribes the file; "
                f"re-export with `speculators export --dtype {declared_name}`",
            )


def declared_dtype(config: dict[str, Any]) -> torch.dtype | None:
    """config.json's ``torch_dtype`` (or the newer ``dtype``) as a torch dtype, None when absent or unknown."""
    name = config.get("torch_dtype") or config.get("dtype")
    return DTYPES_BY_NAME.get(str(name).removeprefix("torch.")) if name else None


def _some(names: list[str]) -> str:
    """Up to three tensor names and how many more: one line even for a whole checkpoint."""
    shown = ", ".join(sorted(names)[:3])
    return shown + (f" (and {len(names) - 3} more)" if len(names) > 3 else "")


def _vocab_findings(config: dict[str, Any], tensors: dict[str, torch.Tensor], error) -> Iterator[Finding]:
    """d2t/t2d must describe one draft vocabulary. Valid offsets can look like ids (keeping every second id gives
    d2t[i] = i + 1, strictly increasing and >= i), so the shape of d2t alone proves nothing: "d2t holds ids, not
    offsets" is suggested only on conclusive evidence (read as offsets the targets leave the vocabulary, or
    disagree with t2d while read as ids they agree), and a consistent mapping is never rejected."""
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None or t2d is None:
        return
    vocab = config["transformer_layer_config"]["vocab_size"]
    if d2t.dtype != torch.int64:
        yield error(f"d2t has dtype {d2t.dtype}; store it as int64")
    if t2d.dtype != torch.bool:
        yield error(f"t2d has dtype {t2d.dtype}; store it as bool")
    if d2t.ndim != 1 or t2d.ndim != 1 or t2d.shape[0] != vocab:
        return
    targets = torch.arange(d2t.shape[0]) + d2t.long()
    kept = torch.nonzero(t2d.bool()).flatten()
    ids_in_range = bool(((d2t >= 0) & (d2t < vocab)).all())
    hint = "; d2t looks like it holds target ids: store offsets, d2t = ids - arange(N)"
    if (targets < 0).any() or (targets >= vocab).any():
        yield error(
            f"d2t maps draft ids outside the verifier vocabulary [0, {vocab}){hint if ids_in_range else ''}"
        )
        return
    if torch.unique(targets).numel() != targets.numel():
        yield error("d2t maps two draft ids to the same verifier id; rebuild the draft vocabulary")
    if kept.numel() != d2t.numel() or not torch.equal(torch.sort(targets).values, kept):
        yield error(
            f"t2d ({kept.numel()} ids set) is inconsistent with d2t ({d2t.numel()} draft ids): t2d must be True "
            "exactly at draft_id + d2t[draft_id]; rebuild both from the same vocabulary"
            + (hint if ids_in_range and _t2d_marks(kept, d2t.long()) else "")
        )


def _t2d_marks(kept: torch.Tensor, ids: torch.Tensor) -> bool:
    """Whether t2d's kept ids are exactly ``ids`` (t2d agrees with d2t read as ids, not as offsets)."""
    return kept.numel() == ids.numel() and torch.equal(torch.sort(ids).values, kept)
