"""Training objectives: how an algorithm's draft is built, which positions are sampled, how attention is masked and
how each drafted position is scored. One module per objective; the trainer loop only calls the interface below.

An objective is keyed by ``train.algorithm`` (``eagle3`` and ``hass`` share the training-time-test objective;
``dflash`` trains anchor blocks; ``peagle`` trains parallel depths on COD-sampled chains) and scores ``steps``
drafted positions per draft: the TTT unroll's steps, a block's draft slots, or P-EAGLE's depths. Step j of a
draft started after position t always targets the verifier's distribution at t+1+j (the token x_{t+2+j}), so the
per-step statistics (:class:`train.step_stats.StepStats`), the simulated acceptance length and the logs mean the
same for every algorithm.

Every module of this package is imported and registers its objective class (:func:`register`): a new algorithm's
objective is a new module, not edits across the trainer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import nn

from speculators.unit_modules import import_unit_modules
from train.data import MicroBatch
from train.losses import StepMasks, step_masks
from train.settings import AlgorithmRules, TrainSettings
from train.step_stats import StepStats
from train.targets import TargetHead, needed_positions, target_draft_ids


@dataclass
class Plan:
    """What an objective decided about one micro batch before the forward: the masks whose trained positions
    are summed over the global batch (the loss normaliser) and whatever its forward needs (``extra``)."""

    masks: StepMasks
    needed: torch.Tensor
    extra: dict[str, Any]
    # float [B, L] per-token loss weights (train.data.training_loss_weight); None: unweighted
    loss_weight: torch.Tensor | None = None


@dataclass(frozen=True)
class MemoryTerms:
    """What an objective adds to the dry-run memory plan beyond the traced step (train.memory_plan): the tensors
    its GPU attention kernel holds for backward that the chunked CPU trace never allocates."""

    padded_keys_bytes: int = 0  # the TTT unroll's flex-padded keys and values (``flex_padded_keys_bytes``)
    block_attention_bytes: dict[str, int] = field(default_factory=dict)  # block flex attention, by part
    max_anchors: int | None = None  # anchors per micro batch, for objectives that sample them


class Objective:
    """Interface of a training objective (see the module docstring)."""

    algorithms: ClassVar[tuple[str, ...]] = ()
    # the recipe groups this objective reads beside the shared ones: top-level key → the frozen dataclass built
    # from it (train.settings.ObjectiveGroup), read through ``settings.group(key)``; a variant may extend its
    # base's dataclass under the same key. A group another objective reads is refused in this one's recipes.
    groups: ClassVar[Mapping[str, type]] = {}
    # whether its draft layers can attend through a sliding window (model.sliding_window)
    sliding_window_layers: ClassVar[bool] = False
    # the recipe key that sets :attr:`steps` (named when train.max_length leaves a step nothing to train)
    steps_key: ClassVar[str] = "train.ttt_steps"
    # whether its loss applies the data's per-token loss weights (``loss_weight``, train/losses.py); the trainer
    # refuses weighted data for an objective that would ignore them
    uses_loss_weights: ClassVar[bool] = False

    def __init__(self, settings: TrainSettings) -> None:
        self.settings = settings

    @property
    def steps(self) -> int:
        """Drafted positions scored per draft."""
        raise NotImplementedError

    @property
    def weights(self) -> list[float]:
        """The static per-step loss weights (what the logged loss is weighted by)."""
        raise NotImplementedError

    @property
    def topk_weight(self) -> float:
        """The weight of a top-K distillation term in the logged loss; none by default."""
        return 0.0

    @classmethod
    def settings_problems(cls, settings: TrainSettings) -> list[str]:
        """Recipe values this objective cannot train together (the generic groups check themselves)."""
        window = settings.model.sliding_window
        if window is not None and not cls.sliding_window_layers:
            return [
                f"model.sliding_window={window} with train.algorithm={settings.train.algorithm}: windowed draft "
                "layers are built for EAGLE-3 and HASS only; set model.sliding_window=null"
            ]
        return []

    def build(
        self, verifier_config: dict[str, Any], features: Any, vocab: Any, head: TargetHead, fresh: bool
    ) -> tuple[Any, nn.Module]:
        """The draft's config (the checkpoint's ``config.json``) and the module accelerate prepares: the draft
        wrapped so that one forward computes everything one backward needs. ``fresh``: no checkpoint will be
        loaded over the weights (data-dependent initialisation is worth its data pass)."""
        raise NotImplementedError

    def meta_model(
        self,
        verifier_config: dict[str, Any],
        aux_layer_ids: list[int],
        draft_vocab_size: int,
        dtype: torch.dtype,
    ) -> tuple[Any, nn.Module]:
        """The recipe's draft config and wrapped model with meta parameters (the dry-run memory plan's)."""
        raise NotImplementedError

    def memory_terms(self, draft_config: Any, dtype: torch.dtype) -> MemoryTerms:
        """This objective's terms of the dry-run memory plan (:class:`MemoryTerms`); none by default."""
        return MemoryTerms()

    def step_masks(
        self,
        batch: MicroBatch,
        loss_mask: torch.Tensor,
        head: TargetHead,
        steps: int,
        evaluating: bool = False,
    ) -> tuple[StepMasks, torch.Tensor]:
        """Every objective's starting point: the positions whose verifier distribution some step targets
        (``needed``) and each step's masks against the verifier's argmax there (the shared convention above).
        Training that keeps out-of-vocab targets (``train.mask_out_of_vocab=false``) needs no full-vocabulary
        argmax: it scores agreement with the verifier's best draft-vocabulary token; ``evaluating`` always
        compares with the verifier's own argmax, so the simulated acceptance length stays exact."""
        needed = needed_positions(loss_mask)
        cheap = not evaluating and not self.settings.train.mask_out_of_vocab
        draft_ids = target_draft_ids(head, batch.last_hidden, needed, within_draft_vocab=cheap)
        masks = step_masks(
            loss_mask, batch.document_ids, draft_ids, steps, self.settings.train.mask_out_of_vocab
        )
        return masks, needed

    def plan(self, batch: MicroBatch, loss_mask: torch.Tensor, head: TargetHead, seed: int) -> Plan:
        """Masks and sampled positions of one training micro batch (``seed``: this micro batch's own, so a
        resumed run samples exactly what it would have)."""
        raise NotImplementedError

    def loss(
        self,
        model: nn.Module,
        batch: MicroBatch,
        plan: Plan,
        head: TargetHead,
        trained: torch.Tensor,
        stats: StepStats,
    ) -> torch.Tensor:
        """The micro batch's loss, each step's sum divided by ``trained[j]`` (the global batch's count)."""
        raise NotImplementedError

    def evaluate(
        self, model: nn.Module, batch: MicroBatch, head: TargetHead, stats: StepStats, steps: int
    ) -> None:
        """Add one held-out batch's terms, positions and acceptance chains (``steps`` drafted positions)."""
        raise NotImplementedError


_REGISTRY: dict[str, type[Objective]] = {}


def register(cls: type[Objective]) -> type[Objective]:
    for name in cls.algorithms:
        _REGISTRY[name] = cls
    return cls


def algorithms() -> tuple[str, ...]:
    _load_all()
    return tuple(sorted(_REGISTRY))


def objective_class(algorithm: str) -> type[Objective]:
    """The objective class that trains ``algorithm`` (what it declares, before any settings exist)."""
    _load_all()
    return _REGISTRY[algorithm]


def objective_for(settings: TrainSettings) -> Objective:
    return objective_class(settings.train.algorithm)(settings)


class ObjectiveRules(AlgorithmRules):
    """The settings' :class:`~train.settings.AlgorithmRules` answered by the objective ``train.algorithm`` names."""

    def groups(self, algorithm: str) -> Mapping[str, type] | None:
        return objective_class(algorithm).groups if algorithm in algorithms() else None

    def readers(self) -> Mapping[str, tuple[str, ...]]:
        found: dict[str, tuple[str, ...]] = {}
        for algorithm in algorithms():
            for key in objective_class(algorithm).groups:
                found[key] = (*found.get(key, ()), algorithm)
        return found

    def resolved(self, settings: TrainSettings) -> TrainSettings:
        if settings.eval.k is not None or settings.train.algorithm not in algorithms():
            return settings
        return replace(settings, eval=replace(settings.eval, k=objective_for(settings).steps))

    def problems(self, settings: TrainSettings) -> list[str]:
        algorithm = settings.train.algorithm
        if algorithm not in algorithms():
            return [f"train.algorithm={algorithm!r}: use one of {', '.join(algorithms())}"]
        return objective_class(algorithm).settings_problems(settings) or row_length_problems(settings)


def row_length_problems(settings: TrainSettings) -> list[str]:
    """Step j of a draft started after position t targets the token at t + 2 + j, so a row trains the deepest of
    ``steps`` drafted positions only when it holds at least ``steps + 2`` tokens: with a shorter
    ``train.max_length`` those steps train on nothing, silently."""
    objective = objective_for(settings)
    steps, length = objective.steps, settings.train.max_length
    if length >= steps + 2:
        return []
    return [
        f"train.max_length={length}: rows shorter than {steps} drafted positions + 2 = {steps + 2} tokens "
        f"({objective.steps_key}) leave the deepest steps nothing to train on; raise train.max_length to at least "
        f"{steps + 2} or lower {objective.steps_key}"
    ]


def train_settings(config: Any) -> TrainSettings:
    """The recipe's :class:`TrainSettings`, every problem reported at once, the algorithm's included."""
    return TrainSettings.from_config(config, ObjectiveRules())


def _load_all() -> None:
    import_unit_modules(__name__, __path__)


__all__ = [
    "MemoryTerms",
    "Objective",
    "Plan",
    "algorithms",
    "objective_class",
    "objective_for",
    "register",
    "train_settings",
]
