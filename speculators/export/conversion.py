"""The conversion steps every ``speculators convert`` layout shares, EAGLE-3 (``convert``) and block drafters
(``speculators.algorithms.dflash.convert``) alike: a source's aux ids and rope brought to the verifier's conventions, and the final
validated write.

They sit below both converters so that each imports them, and neither imports the other back (issue 30).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from speculators import families
from speculators.export.model_card import CardInfo, render_model_card
from speculators.export.tensors import ascending_aux_layers, standard_tensors, warn
from speculators.export.writer import write_validated
from speculators.format.config import ProposalMethod, rope_settings
from speculators.format.validate import Finding
from speculators.verifier import resolve_dtype


class UnsupportedDraftError(ValueError):
    """The source is no draft any unit converts, and cannot become one by conversion (e.g. EAGLE-1/HASS)."""


def shifted_aux_ids(
    ids: list[int] | None, convention: str, num_verifier_layers: int, where: str
) -> list[int]:
    """Aux ids in vLLM's convention. ``convention`` is the SOURCE's: ``output-of-layer`` ids are one lower
    (a layer's output is the stream entering the next) and get +1 with a warning. No ids → vLLM's default."""
    if ids is None:
        return families.default_aux_layer_ids(num_verifier_layers)
    ids = [int(i) for i in ids]
    if convention == "output-of-layer":
        shifted = [i + 1 for i in ids]
        warn(
            f"{where}: aux layer ids {ids} are in the output-of-layer convention (SGLang/SpecForge); shifted by +1 "
            f"to vLLM's convention (the stream entering layer k): {shifted}. Use --aux-convention vllm if they "
            "already were."
        )
        ids = shifted
    bad = [i for i in ids if not 0 <= i <= num_verifier_layers]
    if bad:
        raise ValueError(
            f"{where}: aux layer ids {bad} fall outside [0, {num_verifier_layers}] for this {num_verifier_layers}-"
            "layer verifier; check --aux-convention (the ±1 convention) and the verifier"
        )
    return ids


def align_rope(layer: dict[str, Any], verifier_config: dict[str, Any], where: str) -> None:
    """Write the verifier's rope settings into the layer config (positions must be encoded as the verifier does;
    a dropped llama3 ``rope_scaling`` broke real Llama-3.1 drafts), warning when the source said otherwise."""
    wanted = rope_settings(verifier_config)
    source = {"rope_theta": layer.get("rope_theta"), "rope_scaling": layer.get("rope_scaling")}
    if "rope_parameters" in layer and source["rope_theta"] is None:
        source = rope_settings({"rope_parameters": layer["rope_parameters"]})
    if source["rope_theta"] is not None and (
        float(source["rope_theta"]) != float(wanted["rope_theta"])
        or source["rope_scaling"] != wanted["rope_scaling"]
    ):
        warn(
            f"{where}: rope settings {source} differ from the verifier's {wanted}; wrote the verifier's "
            "(the draft must encode positions as the verifier does)"
        )
    layer.pop("rope_parameters", None)
    layer.update(wanted)
    verifier_positions = verifier_config.get("max_position_embeddings")
    if verifier_positions and int(layer.get("max_position_embeddings") or 0) < int(verifier_positions):
        layer["max_position_embeddings"] = int(verifier_positions)


def write_converted(
    config: Any,
    tensors: dict[str, torch.Tensor],
    src: Path,
    out_dir: str | Path,
    layout: str,
    verifier_ref: str | Path,
    verifier_path: str,
    verifier_config: dict[str, Any],
    speculative_tokens: int | None,
    dtype: str,
    model_card: bool,
) -> tuple[dict[str, Any], list[Finding]]:
    """What every converter ends with, whatever the draft type: the served k, the dtype, the standard tensors
    (verifier-owned ones filled), aux layers ascending, the model card, then the validated atomic write."""
    where = str(src)
    if speculative_tokens is not None:
        methods = config.speculators_config.proposal_methods
        methods[0] = ProposalMethod(**{**methods[0].__dict__, "speculative_tokens": int(speculative_tokens)})
    config.torch_dtype = dtype
    config_dict = config.to_dict()
    weights = standard_tensors(
        tensors, config_dict, resolve_dtype(dtype), verifier_dir=verifier_path, where=where
    )
    config_dict, weights = ascending_aux_layers(config_dict, weights, where)
    extra = {}
    if model_card:
        extra["README.md"] = render_model_card(
            CardInfo(
                config=config_dict,
                verifier_ref=str(verifier_ref),
                source=f"converted from the {layout} layout (`{src}`)",
                vllm_refusal=families.of_config(verifier_config).vllm_refusal or None,
            )
        )
    findings = write_validated(
        out_dir, config_dict, weights, verifier_config, extra, sources=(src, verifier_path)
    )
    return config_dict, findings


__all__ = ["align_rope", "shifted_aux_ids", "write_converted"]
