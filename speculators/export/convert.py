"""``speculators convert SRC OUT_DIR``: a draft in another producer's layout → a validated standard checkpoint.

Each unit that reads other layouts declares its converter (``Algorithm.converter``: a module of its own package,
e.g. EAGLE-3's ``speculators.algorithms.eagle3.convert``, the block drafters' ``speculators.algorithms.dflash.
convert``). A converter module holds ``LAYOUTS`` (the ``--from`` names it reads), ``DETECT_ORDER`` (when it is asked,
lowest first), ``detect(config, tensors, where)`` (its layout for a source, or None) and ``convert(...)`` (the
source → a validated directory). This module only reads the source, asks the converters in order which layout it
is, and hands it to the one that claims it: it names no algorithm and no layout.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from speculators import algorithms
from speculators.export.conversion import UnsupportedDraftError
from speculators.export.exporter import EXPORT_DTYPES, check_speculative_tokens
from speculators.export.sources import read_config, read_weights
from speculators.export.tensors import warn
from speculators.format.config import verifier_name_or_path
from speculators.format.validate import Finding
from speculators.outputs import EXPORT_OUTPUT, check_output_dir

AUX_CONVENTIONS = ("auto", "vllm", "output-of-layer")
FLAG_MODES = ("max-compat", "keep")


@dataclass
class ConvertResult:
    out_dir: Path
    layout: str
    config: dict[str, Any]
    findings: list[Finding] = field(default_factory=list)
    replaced: bool = False  # out_dir held an earlier export, now replaced


def converters() -> list[ModuleType]:
    """Every unit's declared converter module, once each, in their ``DETECT_ORDER``."""
    modules = {algorithms.get(name).converter for name in algorithms.names()} - {""}
    return sorted((importlib.import_module(m) for m in modules), key=lambda m: (m.DETECT_ORDER, m.__name__))


def layouts() -> tuple[str, ...]:
    """Every ``--from`` layout some unit converts (in the order the converters are asked)."""
    return tuple(dict.fromkeys(layout for module in converters() for layout in module.LAYOUTS))


def __getattr__(name: str) -> Any:
    if name == "LAYOUTS":  # computed from the units when asked: importing them here would be circular
        return layouts()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def claim(
    config: dict[str, Any], tensors: dict[str, torch.Tensor], where: str = "source"
) -> tuple[str, ModuleType]:
    """The layout of a source and the converter that reads it: the first converter (in order) to recognise it;
    ``UnsupportedDraftError`` when a converter knows it for a draft nothing converts, ``ValueError`` when none
    recognises it."""
    for module in converters():
        layout = module.detect(config, tensors, where)
        if layout is not None:
            return layout, module
    raise ValueError(
        f"{where}: not a layout this converter knows (no speculators_config, no architecture or weights of a "
        f"known producer); pass --from one of {layouts()} if you know better"
    )


def detect_layout(config: dict[str, Any], tensors: dict[str, torch.Tensor], where: str = "source") -> str:
    """One of :func:`layouts`; raises ``UnsupportedDraftError`` (e.g. EAGLE-1/HASS) or ``ValueError`` (unknown)."""
    return claim(config, tensors, where)[0]


def convert_checkpoint(
    src: str | Path,
    out_dir: str | Path,
    layout: str = "auto",
    verifier: str | None = None,
    verifier_name: str | None = None,
    aux_convention: str = "auto",
    flags: str = "max-compat",
    norm_before_residual: bool | None = None,
    speculative_tokens: int | None = None,
    dtype: str = "bfloat16",
    model_card: bool = True,
) -> ConvertResult:
    """Convert ``src`` (any of :func:`layouts`) to a validated standard checkpoint in ``out_dir`` (atomic).

    ``verifier`` (a local dir, hub id or ``smollm2``) is required for layouts that do not name one; its config
    decides the vocabulary, the layer count for aux ids and the rope settings, and its embedding fills a missing
    ``embed_tokens``. ``aux_convention`` says how the SOURCE's aux ids count (``auto``: ids under SGLang's
    ``eagle_config`` are output-of-layer, every other place vLLM's). The converter that recognises the source
    converts it, whatever ``layout`` was asked (a mismatch is warned).
    """
    known = layouts()
    if layout not in ("auto", *known):
        raise ValueError(f"--from {layout!r}: use auto or one of {known}")
    if aux_convention not in AUX_CONVENTIONS:
        raise ValueError(f"--aux-convention {aux_convention!r}: use one of {AUX_CONVENTIONS}")
    if flags not in FLAG_MODES:
        raise ValueError(f"--flags {flags!r}: use one of {FLAG_MODES}")
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype {dtype!r}: use one of {EXPORT_DTYPES}")
    check_speculative_tokens(speculative_tokens)
    src = Path(src)
    where = str(src)
    if not src.exists():
        raise FileNotFoundError(f"{src} does not exist; pass the directory of the draft to convert")
    replaced = check_output_dir(out_dir, EXPORT_OUTPUT, (src, verifier))  # before any weight is read
    source_config, tensors = read_config(src), read_weights(src)
    detected, module = claim(source_config, tensors, where)
    if layout == "auto":
        layout = detected
    elif layout != detected:
        warn(f"{where}: looks like the {detected} layout, converting as --from {layout} as asked")
    source_verifier = verifier_name_or_path(source_config)
    verifier_ref = verifier or (source_verifier if layout == "speculators" else None)
    if not verifier_ref:
        raise ValueError(
            f"{where}: the {layout} layout does not name its verifier; pass --verifier (a local HF directory, a "
            "cached hub id, or smollm2)"
        )
    config_dict, findings = module.convert(
        src, out_dir, layout, source_config, tensors, verifier, str(verifier_ref), verifier_name, source_verifier,
        aux_convention, flags, norm_before_residual, speculative_tokens, dtype, model_card,
    )  # fmt: skip
    return ConvertResult(
        out_dir=Path(out_dir), layout=layout, config=config_dict, findings=findings, replaced=replaced
    )


__all__ = [
    "AUX_CONVENTIONS",
    "FLAG_MODES",
    "ConvertResult",
    "UnsupportedDraftError",
    "convert_checkpoint",
    "converters",
    "detect_layout",
    "layouts",
]
