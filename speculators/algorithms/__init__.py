"""Drafting algorithms as declared units, keyed by ``speculators_model_type``.

An algorithm declares, in one module of this package (``eagle3.py``, ``dflash.py``, ...):

* its config class (``config.json``) and model class (one module serving training, decoding and export);
* how the engine drafts with it: ``sequential`` (k forwards for k tokens, EAGLE-3), ``block`` (one forward over a
  block against context features, DFlash) or ``parallel`` (one forward of K slots over an EAGLE-3 KV cache, P-EAGLE);
* its export spec: the aux-layer ids it reads, the speculative tokens it serves, the tensors it must hold and the
  validator rules of its own keys, and how vLLM is told to run it.

The trainer (``train/objectives``), the exporter, the validator and the engine look the unit up here and call it;
none of them branches on the algorithm's name. A new algorithm is a new module in this package: every module here
is imported and registers itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from speculators.unit_modules import import_unit_modules

# fc's input columns and the optional norm over its input (``norm_before_fc``): every draft with an fc over aux states
AUX_BLOCKED_BY_FC: tuple[tuple[str, int], ...] = (("fc.weight", 1), ("input_norm.weight", 0))


@dataclass(frozen=True)
class Algorithm:
    """One drafting algorithm (see the module docstring)."""

    name: str  # speculators_model_type
    config_class: type
    model_class: type
    drafting: str  # "sequential", "block" or "parallel"
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
    # ``train.algorithm`` values that train this model besides its own name, each with how people name it (HASS:
    # an objective on the EAGLE-3 model); the run's recorded algorithm tells the exporter the unit through it
    trained_as: tuple[tuple[str, str], ...] = ()
    # this type's own config keys the model card lists (beside the shape, vocabulary, aux ids and tokens)
    card_keys: tuple[str, ...] = ()
    # the draft config rebuilt from ZeRO shards saved without one: (unprefixed tensors, verifier config, verifier
    # path, the run's recipe) -> config dict. None: this type's config cannot be told from them
    config_from_weights: (
        Callable[[dict[str, torch.Tensor], dict[str, Any], str, dict[str, Any]], dict[str, Any]] | None
    ) = None

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
    return get(str(config.get("speculators_model_type") or "eagle3"))


def trained_by(algorithm: str) -> Algorithm:
    """The unit a ``train.algorithm`` trains (its own name, or one it declares in ``trained_as``)."""
    for unit in (get(name) for name in names()):
        if algorithm == unit.name or algorithm in dict(unit.trained_as):
            return unit
    raise ValueError(f"train.algorithm {algorithm!r} trains none of the declared algorithms {names()}")


def display_name(algorithm: str) -> str:
    """How people name a ``speculators_model_type`` or a ``train.algorithm`` (``hass`` → ``HASS``); empty for
    a name no unit declares."""
    try:
        unit = trained_by(algorithm)
    except ValueError:
        return ""
    return dict(unit.trained_as).get(algorithm) or unit.display_name or unit.name


def load_draft(directory: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """Any speculators checkpoint directory → its draft model."""
    from speculators.format.checkpoint import read_config

    return of_config(read_config(directory)).load(directory, dtype)


__all__ = [
    "AUX_BLOCKED_BY_FC",
    "Algorithm",
    "display_name",
    "get",
    "load_draft",
    "names",
    "of_config",
    "register",
    "trained_by",
]
