"""``speculators export RUN_OR_CHECKPOINT OUT_DIR``: a trainer checkpoint → a standard speculators directory.

The trainer writes fp32 drafts (or only DeepSpeed ZeRO shards); what users serve is a bf16 directory whose
config names the real verifier, carries the recipe's ``speculative_tokens``, and comes with a model card. The
result is validated against the verifier's config before it is renamed into place (see ``writer``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from speculators import algorithms, families
from speculators.export.model_card import (
    CardInfo,
    add_eval_results,
    find_eval_artifacts,
    k_from_sweep,
    k_sweep_table,
    read_eval_results,
    render_model_card,
    training_summary,
    validation_artifacts,
)
from speculators.export.sources import read_config
from speculators.export.tensors import ascending_aux_layers, detect_prefix, standard_tensors, unprefixed
from speculators.export.writer import write_validated
from speculators.format.config import ProposalMethod, VerifierRef
from speculators.format.validate import Finding
from speculators.lineage import read_lineage
from speculators.outputs import EXPORT_OUTPUT, check_output_dir
from speculators.runs import TrainerCheckpoint, list_checkpoints, locate_checkpoint, recipe_value
from speculators.verifier import embedded_weights_note, resolve_dtype, resolve_verifier_path

EXPORT_DTYPES = ("bfloat16", "float32", "float16")


@dataclass
class ExportResult:
    out_dir: Path
    checkpoint: TrainerCheckpoint
    config: dict[str, Any]
    findings: list[Finding] = field(default_factory=list)  # warnings only: errors refuse the export
    replaced: bool = False  # out_dir held an earlier export, now replaced


def load_verifier_config(name_or_path: str) -> tuple[str, dict[str, Any]]:
    """``(resolved name_or_path, HF config dict)``, read as the verifier's family declares: a wrapper's
    ``text_config`` at the top level and a per-attention-type rope narrowed to the one its drafts copy
    (:meth:`speculators.families.Family.layer_source`), so conversion and validation see the draft's view."""
    from speculators import families

    path = resolve_verifier_path(name_or_path)
    if Path(path, "config.json").is_file():
        config = read_config(path)
        return str(Path(path).resolve()), families.of_config(config).layer_source(config)
    from speculators.verifier import verifier_config_dict

    try:
        config = verifier_config_dict(path)
        return path, families.of_config(config).layer_source(config)
    except OSError as exc:
        raise FileNotFoundError(
            f"cannot read the verifier config of {name_or_path!r} ({exc}); pass a local directory with --verifier"
        ) from exc


def check_speculative_tokens(speculative_tokens: int | None) -> None:
    """A proposal length consumers can serve: vLLM drafts at least one token per step (0 used to be ignored, and
    the recipe's value written without a word)."""
    if speculative_tokens is not None and speculative_tokens < 1:
        raise ValueError(
            f"--speculative-tokens {speculative_tokens}: vLLM drafts at least 1 token per step; give 1 or more"
        )


def export_checkpoint(
    source: str | Path,
    out_dir: str | Path,
    speculative_tokens: int | None = None,
    dtype: str = "bfloat16",
    verifier: str | None = None,
    verifier_name: str | None = None,
    model_card: bool = True,
    eval_results: str | Path | None = None,
    k_from_eval: str | Path | None = None,
    serve_concurrency: int = 1,
) -> ExportResult:
    """Export the checkpoint ``source`` means (run dir → best, else latest) to ``out_dir``.

    ``verifier`` overrides the recipe's verifier (used for the cross-checks and ``embed_tokens``);
    ``verifier_name`` is written as ``verifier.name_or_path`` instead of the resolved local path (e.g. a hub id
    for publishing). ``speculative_tokens`` overrides the recipe's ``export.speculative_tokens``.
    ``eval_results``: a ``results.json`` of ``speculators eval`` (e.g. of a previous export of this draft) whose
    measurements the model card shows; one inside the run directory is found without it. ``k_from_eval``: a
    ``results.json`` of ``speculators eval --concurrency ...`` whose k x concurrency sweep chooses
    ``speculative_tokens`` (the fastest k at ``serve_concurrency``); the card shows the sweep.
    """
    if dtype not in EXPORT_DTYPES:
        raise ValueError(
            f"dtype {dtype!r}: use one of {EXPORT_DTYPES} (bfloat16 is what drafts are published in)"
        )
    check_speculative_tokens(speculative_tokens)
    if serve_concurrency < 1:
        raise ValueError(
            f"--serve-concurrency {serve_concurrency}: give the number of requests served at once (1 or more)"
        )
    checkpoint = locate_checkpoint(source)  # a missing source is said here; no weight is read yet
    sources = (source, verifier, eval_results, k_from_eval)
    replaced = check_output_dir(out_dir, EXPORT_OUTPUT, sources)  # before any weight is read
    if model_card and eval_results is not None:
        read_eval_results(eval_results)  # a mistyped --eval-results fails before any weight is converted
    sweep = None
    if k_from_eval is not None:
        measured, sweep = k_from_sweep(k_from_eval, serve_concurrency)
        if speculative_tokens is not None and speculative_tokens != measured:
            raise ValueError(
                f"--speculative-tokens {speculative_tokens} and --k-from-eval (k={measured} at concurrency "
                f"{serve_concurrency}) disagree; give one of them"
            )
        speculative_tokens = measured
    draft_config, tensors = read_trainer_weights(checkpoint)
    verifier_ref = (
        verifier
        or recipe_value(checkpoint.recipe, "verifier.name_or_path")
        or recipe_value(draft_config or {}, "speculators_config.verifier.name_or_path")
    )
    if not verifier_ref:
        raise ValueError(f"{checkpoint.label}: no recipe or draft config names the verifier; pass --verifier")
    verifier_path, verifier_config = load_verifier_config(str(verifier_ref))
    if draft_config is None or not draft_config.get("speculators_config"):
        draft_config = infer_draft_config(tensors, verifier_config, verifier_path, checkpoint.recipe)
    config = algorithms.of_config(draft_config).config_class.from_dict(draft_config)
    config.speculators_config.verifier = VerifierRef(
        name_or_path=verifier_name or verifier_path,
        architectures=list(
            verifier_config.get("architectures") or config.speculators_config.verifier.architectures
        ),
    )
    tokens = (
        speculative_tokens
        if speculative_tokens is not None
        else recipe_value(checkpoint.recipe, "export.speculative_tokens")
    )
    if tokens is not None:
        methods = config.speculators_config.proposal_methods
        methods[0] = ProposalMethod(**{**methods[0].__dict__, "speculative_tokens": int(tokens)})
    config.torch_dtype = dtype
    config_dict = config.to_dict()
    weights = standard_tensors(
        tensors, config_dict, resolve_dtype(dtype), verifier_dir=verifier_path, where=checkpoint.label
    )
    config_dict, weights = ascending_aux_layers(config_dict, weights, checkpoint.label)
    lineage = read_lineage(
        checkpoint.run_dir
    )  # an adapted draft says its parent and traffic window (no text)
    if lineage is not None:
        config_dict["lineage"] = lineage
    extra: dict[str, str | bytes | Path] = {}
    if model_card:
        evals = find_eval_artifacts(checkpoint.run_dir)
        validation_artifacts(checkpoint.run_dir, checkpoint.step, evals)
        if eval_results is not None:
            add_eval_results(evals, eval_results)
        if sweep is not None:
            evals.tables.append(k_sweep_table(sweep, serve_concurrency, str(k_from_eval)))
        card = CardInfo(
            config=config_dict,
            verifier_ref=str(verifier_ref),
            source=describe_source(checkpoint),
            verifier_note=embedded_weights_note(verifier_path),
            recipe=checkpoint.recipe,
            training=training_summary(checkpoint.run_dir, checkpoint.trainer_state, checkpoint.best),
            evals=evals,
            run_dir=checkpoint.run_dir,
            vllm_refusal=families.of_config(verifier_config).vllm_refusal or None,
            lineage=lineage,
        )
        extra["README.md"] = render_model_card(card)
        extra.update(evals.plots)
    findings = write_validated(
        out_dir, config_dict, weights, verifier_config, extra, sources=(*sources, verifier_path)
    )
    return ExportResult(
        out_dir=Path(out_dir), checkpoint=checkpoint, config=config_dict, findings=findings, replaced=replaced
    )


def read_trainer_weights(
    checkpoint: TrainerCheckpoint,
) -> tuple[dict[str, Any] | None, dict[str, torch.Tensor]]:
    """``(draft config or None, tensors)``: the trainer's draft/ directory when present, else the gathered ZeRO
    shards with the config of a sibling checkpoint (same run, same architecture) when one exists."""
    if checkpoint.draft_dir is not None:
        from speculators.export.sources import read_weights

        return read_config(checkpoint.draft_dir), read_weights(checkpoint.draft_dir)
    if checkpoint.state_dir is None:
        raise FileNotFoundError(f"{checkpoint.label} has neither draft/ nor state/; nothing to export")
    from speculators.export.zero import gather_zero_state

    tensors = unprefixed(gather_zero_state(checkpoint.state_dir), f"{checkpoint.state_dir} (ZeRO)")
    sibling = _sibling_draft_config(checkpoint)
    return sibling, tensors


def _sibling_draft_config(checkpoint: TrainerCheckpoint) -> dict[str, Any] | None:
    if checkpoint.run_dir is None:
        return None
    for _, step in reversed(list_checkpoints(checkpoint.run_dir)):
        if (step / "draft" / "config.json").is_file():
            return read_config(step / "draft")
    return None


def infer_draft_config(
    tensors: dict[str, torch.Tensor],
    verifier_config: dict[str, Any],
    verifier_path: str,
    recipe: dict[str, Any],
) -> dict[str, Any]:
    """A draft config rebuilt for ZeRO shards saved without any: the run's recorded ``train.algorithm`` names the
    unit, which rebuilds it from the verifier, the recipe and the tensors (``Algorithm.config_from_weights``)."""
    unit = algorithms.trained_by(str(recipe_value(recipe, "train.algorithm", algorithms.LEGACY_TYPE)))
    if unit.config_from_weights is None:
        raise ValueError(
            f"the ZeRO shards hold a {unit.display_name or unit.name} draft, whose config cannot be rebuilt from its "
            "weights, and no checkpoint of the run has a draft/config.json to take it from; export a checkpoint step "
            "that has draft/"
        )
    names = unprefixed(tensors, "ZeRO state") if detect_prefix(list(tensors)) else tensors
    return unit.config_from_weights(names, verifier_config, verifier_path, recipe)


def describe_source(checkpoint: TrainerCheckpoint) -> str:
    if checkpoint.step_dir is None:
        return f"re-exported from `{checkpoint.draft_dir}`"
    how = {"best": "the best checkpoint by acceptance length", "latest": "the latest checkpoint"}.get(
        checkpoint.selected_by, "the given checkpoint"
    )
    kind = "draft weights" if checkpoint.draft_dir is not None else "gathered DeepSpeed ZeRO shards"
    return f"step {checkpoint.step} ({how}), {kind}"
