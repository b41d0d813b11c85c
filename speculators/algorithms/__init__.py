"""Drafting algorithms as declared units, keyed by ``speculators_model_type``.

An algorithm is one package here (``eagle3/``, ``dflash/``, ...) holding its own pieces: ``config.py`` (its
``config.json`` class), ``model.py`` (one module serving training, decoding and export), ``drafter.py`` (how the
engine drafts with it, when not another algorithm's drafter) and whatever else is its own (EAGLE-3's validator
``rules.py``, the block drafters' ``convert.py``). Its ``__init__`` declares the unit:

* its config and model classes;
* how the engine drafts with it: ``sequential`` (k forwards for k tokens, EAGLE-3), ``block`` (one forward over a
  block against context features, DFlash) or ``parallel`` (one forward of K slots over an EAGLE-3 KV cache, P-EAGLE),
  and the drafter class doing it;
* its export spec: the aux-layer ids it reads, the speculative tokens it serves, the tensors it must hold and the
  validator rules of its own keys, and how vLLM is told to run it.

The trainer (``train/objectives``), the exporter, the validator and the engine look the unit up here and call it;
none of them branches on the algorithm's name. A new algorithm is a new package here: every module and package
here is imported and registers itself.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from speculators.unit_modules import import_unit_modules

# the type a config without ``speculators_model_type`` is (older exports were all EAGLE-3): the one place shared code
# names it (:func:`of_config`, the format's default ``speculators_config.algorithm``, a recipe's default algorithm)
LEGACY_TYPE = "eagle3"

# fc's input columns and the optional norm over its input (``norm_before_fc``): every draft with an fc over aux states
AUX_BLOCKED_BY_FC: tuple[tuple[str, int], ...] = (("fc.weight", 1), ("input_norm.weight", 0))


@dataclass(frozen=True)
class Variant:
    """A drafter people name on its own that is a unit's model trained another way or with some of the unit's own
    config keys set: HASS (an objective on the EAGLE-3 model, same config) or EAGLE-3.1 (EAGLE-3 with
    ``norm_before_fc`` and ``norm_output`` true). Its name is a ``train.algorithm`` value; the export keeps the
    unit's ``speculators_model_type``, which is what the consumers read."""

    name: str  # the train.algorithm value
    display_name: str  # how people name it (model cards, plots)
    # the unit's own config keys this variant sets, as (key, value): the trainer builds the draft with them and a
    # config holding them all is named after the variant; () when it differs only in training (HASS)
    config: tuple[tuple[str, Any], ...] = ()
    article: str = "A"  # the indefinite article its display name takes when spoken ("An EAGLE-3.1 draft")

    def matches(self, config: dict[str, Any]) -> bool:
        """Whether a ``config.json`` dict is this variant's (it sets every key the variant declares)."""
        return bool(self.config) and all(config.get(key) == value for key, value in self.config)


@dataclass(frozen=True)
class Algorithm:
    """One drafting algorithm (see the module docstring)."""

    name: str  # speculators_model_type
    config_class: type
    model_class: type
    drafting: str  # "sequential", "block" or "parallel"
    drafter_class: type  # the engine's drafter for it (speculators.decoding.drafters asks the unit for it)
    aux_layer_key: (
        str  # the config key holding the aux-layer ids (vLLM convention: residual entering layer k)
    )
    config_rules: Callable[[dict[str, Any]], Iterator[str]]  # errors in this type's own keys
    expected_shapes: Callable[
        [dict[str, Any]], dict[str, tuple[int, ...]]
    ]  # every tensor the checkpoint holds
    vllm_method: str  # the speculative method vLLM runs it under
    # what vLLM needs besides method/model/num_speculative_tokens to run it as trained (e.g. parallel drafting)
    vllm_extra: Callable[[dict[str, Any]], dict[str, Any]] = lambda config: {}
    # legal but surprising settings of this type's own keys (e.g. one a consumer runs differently than trained)
    config_warnings: Callable[[dict[str, Any]], Iterator[str]] = lambda config: iter(())
    display_name: str = ""  # how people name it (model cards); the type name when empty
    article: str = (
        "A"  # the indefinite article the display name takes when spoken ("An MTP draft", "A DFlash draft")
    )
    # warnings from the tensors against the verifier's (its name_or_path, when local): e.g. weights a consumer
    # replaces with the verifier's on load, so that the consumers would draft differently
    weight_warnings: Callable[[dict[str, Any], dict[str, torch.Tensor], str | None], Iterator[str]] = (
        lambda config, tensors, verifier: iter(())
    )
    # tensors laid out per aux layer: (name, dim) where ``dim`` concatenates one equal block per aux id in the
    # config's order. When the exporter sorts the aux ids (vLLM concatenates the states ascending) every one of
    # them is permuted alike, or the draft reads its features shuffled (speculators.export.tensors)
    aux_blocked_tensors: tuple[tuple[str, int], ...] = AUX_BLOCKED_BY_FC
    # a checkpoint may leave ``embed_tokens`` out: every consumer takes the verifier's embedding then (speculators
    # 0.9.0 rebuilds it on load for DFlash/DSpark and saves none; vLLM shares the target's). False keeps the format
    # rule "always write it": older speculators releases loaded an absent EAGLE-3 embedding as uninitialised memory
    embed_from_verifier: bool = False
    # ``architectures`` strings other producers write for this type besides ours (``config_class.ARCHITECTURE``, also
    # the speculators package's config default): the model class speculators 0.9.0's ``save_pretrained`` writes
    # (``PEagleDraftModel``). Both consumers pick the model by ``speculators_model_type``, so each is legal; the
    # validator warns only on a string no producer writes (see ``architectures``)
    other_architectures: tuple[str, ...] = ()
    # ``train.algorithm`` values that train this model besides its own name (:class:`Variant`: HASS, EAGLE-3.1);
    # the run's recorded algorithm tells the exporter the unit through it
    trained_as: tuple[Variant, ...] = ()
    # this type's own config keys the model card lists (beside the shape, vocabulary, aux ids and tokens)
    card_keys: tuple[str, ...] = ()
    # the draft config rebuilt from ZeRO shards saved without one: (unprefixed tensors, verifier config, verifier
    # path, the run's recipe) -> config dict. None: this type's config cannot be told from them
    config_from_weights: (
        Callable[[dict[str, torch.Tensor], dict[str, Any], str, dict[str, Any]], dict[str, Any]] | None
    ) = None
    # ``transformer_layer_config`` is the verifier's own config, not a draft layer of a declared draft layer type,
    # and the draft predicts over the verifier's whole vocabulary without a ``draft_vocab_size`` key (MTP: the
    # verifier's own MTP layer); the shared rules on both then leave the config to the unit's ``config_rules``
    verifier_layer_config: bool = False
    # the one tensor every checkpoint of this type holds: the exporter finds a wrapper's name prefix from it
    anchor_tensor: str = "lm_head.weight"
    # why no vLLM release serves this type from a speculators checkpoint (empty: vLLM serves it); the model card
    # then points at our engine instead of printing a `vllm serve` that fails
    vllm_unserved: str = ""
    # the module of this unit's own package that converts other producers' layouts of it (``speculators convert``:
    # ``LAYOUTS``, ``DETECT_ORDER``, ``detect``, ``convert``; see speculators.export.convert); '' when none does
    converter: str = ""
    # the class speculators 0.9.0 builds and loads this type with (``speculators.models.<type>.<class>``): the
    # speculators-package bridge asks its worker for it by this name (the worker runs where our registry is not)
    package_class: str = ""
    # the config.json vLLM's own loader reads for this type from a checkpoint without ``speculators_config``, when
    # that is the only way vLLM serves it (LiLiCorr: its DFlash-shaped checkpoint); None: not needed or not known
    vllm_native_config: Callable[[dict[str, Any]], dict[str, Any]] | None = None

    def vllm_native_copy(self, draft_dir: str | Path, out_dir: str | Path) -> Path:
        """``out_dir``: the export as vLLM's own loader reads it (:attr:`vllm_native_config`'s config.json, every
        other file linked to the export's), written under a temporary name and renamed, replacing an older copy."""
        from speculators.atomic import atomic_write_json
        from speculators.format.checkpoint import read_config

        if self.vllm_native_config is None:
            raise ValueError(
                f"{self.name}: vLLM serves it from its speculators checkpoint; no native copy is declared"
            )
        source, out = Path(draft_dir).resolve(), Path(out_dir)
        staging = out.with_name(f".{out.name}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for item in source.iterdir():
            if item.name != "config.json":
                (staging / item.name).symlink_to(item)
        atomic_write_json(staging / "config.json", self.vllm_native_config(read_config(source)))
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
        return out

    def variant(self, algorithm: str) -> Variant | None:
        """The declared variant a ``train.algorithm`` names; None for the unit's own name or an unknown one."""
        return next((v for v in self.trained_as if v.name == algorithm), None)

    def name_of(self, config: dict[str, Any]) -> str:
        """How people name a draft of this type from its ``config.json`` alone: the variant whose keys it sets
        (EAGLE-3.1), else the unit's display name."""
        chosen = next((v for v in self.trained_as if v.matches(config)), None)
        return chosen.display_name if chosen else (self.display_name or self.name)

    def article_of(self, config: dict[str, Any]) -> str:
        """The article :meth:`name_of`'s name takes: the matching variant's, else the unit's."""
        chosen = next((v for v in self.trained_as if v.matches(config)), None)
        return chosen.article if chosen else self.article

    @property
    def architectures(self) -> tuple[str, ...]:
        """Every ``architectures`` string accepted for this type: ours (what the exporter writes) first."""
        ours = self.config_class.ARCHITECTURE
        return (ours, *(a for a in self.other_architectures if a != ours))

    def aux_layer_ids(self, config: Any) -> list[int]:
        """The aux-layer ids of a config object or dict."""
        data = config if isinstance(config, dict) else config.to_dict()
        return [int(i) for i in data.get(self.aux_layer_key) or []]

    def load(self, directory: str | Path, dtype: torch.dtype = torch.float32) -> Any:
        return self.model_class.from_pretrained(
            directory, dtype=dtype, embed_from_verifier=self.embed_from_verifier
        )

    def vllm_speculative_config(
        self, draft_dir: str | Path, config: dict[str, Any], k: int
    ) -> dict[str, Any]:
        """``speculative_config`` for vLLM with ``k`` draft tokens per step."""
        spec = {"method": self.vllm_method, "model": str(draft_dir), "num_speculative_tokens": int(k)}
        spec.update(self.vllm_extra(config))
        return spec


_REGISTRY: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    if algorithm.name in _REGISTRY:
        raise ValueError(f"algorithm {algorithm.name!r} is registered twice")
    _REGISTRY[algorithm.name] = algorithm
    return algorithm


def _load_all() -> None:
    import_unit_modules(__name__, __path__)


def names() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def get(name: str) -> Algorithm:
    """The algorithm of a ``speculators_model_type``; a clear error for an unknown one."""
    _load_all()
    if name not in _REGISTRY:
        raise ValueError(
            f"speculators_model_type {name!r} is not one this project trains or reads: one of {names()}"
        )
    return _REGISTRY[name]


def of_config(config: dict[str, Any]) -> Algorithm:
    """The algorithm a ``config.json`` dict declares (eagle3 when the key is absent, as older exports were)."""
    return get(str(config.get("speculators_model_type") or LEGACY_TYPE))


def trained_by(algorithm: str) -> Algorithm:
    """The unit a ``train.algorithm`` trains (its own name, or one it declares in ``trained_as``)."""
    for unit in (get(name) for name in names()):
        if algorithm == unit.name or unit.variant(algorithm) is not None:
            return unit
    raise ValueError(f"train.algorithm {algorithm!r} trains none of the declared algorithms {names()}")


def display_name(algorithm: str) -> str:
    """How people name a ``speculators_model_type`` or a ``train.algorithm`` (``hass`` → ``HASS``); empty for
    a name no unit declares."""
    try:
        unit = trained_by(algorithm)
    except ValueError:
        return ""
    chosen = unit.variant(algorithm)
    return chosen.display_name if chosen else (unit.display_name or unit.name)


def variant_config(algorithm: str) -> dict[str, Any]:
    """The unit config keys a ``train.algorithm`` sets (EAGLE-3.1's two norm flags); empty for a unit's own name,
    a training-only variant (HASS) or a name no unit declares."""
    try:
        chosen = trained_by(algorithm).variant(algorithm)
    except ValueError:
        return {}
    return dict(chosen.config) if chosen else {}


def load_draft(directory: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """Any speculators checkpoint directory → its draft model."""
    from speculators.format.checkpoint import read_config

    return of_config(read_config(directory)).load(directory, dtype)


__all__ = [
    "AUX_BLOCKED_BY_FC",
    "LEGACY_TYPE",
    "Algorithm",
    "Variant",
    "display_name",
    "get",
    "load_draft",
    "names",
    "of_config",
    "register",
    "trained_by",
    "variant_config",
]
