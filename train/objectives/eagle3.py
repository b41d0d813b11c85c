"""EAGLE-3, HASS and EAGLE-3.1: the k-step training-time-test unroll over every position (train/unroll.py).

Every position t of a row drafts: step j feeds token x_{t+1+j} and the draft's own hidden state from step j-1 (the
projected verifier feature at j=0) and is scored against the verifier's distribution at t+1+j. Step j weighs
``step_weight_decay**j``; HASS (:class:`HassTrainingTimeTest`) adds its top-K distillation term and feeds the
previous step's features detached, both from its ``hass`` settings group (:class:`HassSettings`,
recipes/hass/default.yaml). EAGLE-3.1 is the same unroll over a draft with ``norm_before_fc`` and ``norm_output``
on (the variant declares them: speculators.algorithms.eagle3). Data with per-token loss weights (traffic where the
serving draft was rejected) weighs each position's CE and top-K term by its target token's weight (train/losses.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from speculators.algorithms import display_name, variant_config
from speculators.algorithms.eagle3 import norm_flags
from speculators.algorithms.eagle3.model import Eagle3DraftModel
from train.assemble import (
    build_draft,
    calibrate_warm_start,
    draft_config,
    recipe_draft_config,
    scale_fc_by_feature_rms,
)
from train.data import MicroBatch, training_loss_weight
from train.losses import RowTerm, StepTerms, step_terms, step_weights
from train.memory_plan import flex_padded_key_bytes
from train.objectives import MemoryTerms, Objective, Plan, register
from train.settings import TrainSettings, at_least
from train.step_stats import StepStats
from train.targets import TargetHead, target_logits
from train.unroll import TTTDraft


@dataclass(frozen=True)
class HassSettings:
    """``hass``: HASS's top-K distillation term and harmonized context (recipes/hass/default.yaml)."""

    topk: int = 10  # K of the top-K distillation loss
    topk_weight: float = 1.0  # its weight (HASS stage 1: 0, stage 2: 1)
    detach_context: bool = True  # feed the previous step's features detached

    def problems(self, prefix: str) -> list[str]:
        return at_least(f"{prefix}.topk", self.topk, 1) + at_least(
            f"{prefix}.topk_weight", self.topk_weight, 0
        )


# the plain unroll: no top-K term, the context not detached
PLAIN_UNROLL = HassSettings(topk_weight=0.0, detach_context=False)


def topk_distillation(draft_logits: torch.Tensor, target_logits: torch.Tensor, k: int) -> torch.Tensor:
    """HASS harmonized objective: ``-Σ_{i ∈ TopK(p)} p_i log q_i`` per row (p, q over the draft vocab)."""
    target = torch.softmax(target_logits.float(), dim=-1)
    top_p, top_i = target.topk(min(k, target.shape[-1]), dim=-1)
    return -(top_p * F.log_softmax(draft_logits.float(), dim=-1).gather(-1, top_i)).sum(-1)


@register
class TrainingTimeTest(Objective):
    algorithms = ("eagle3", "eagle31")
    sliding_window_layers = True
    uses_loss_weights = True  # every step's CE (and HASS's top-K term) per token (train/losses.py)

    @classmethod
    def harmonized(cls, settings: TrainSettings) -> HassSettings:
        """The top-K term and context detach in force: off (:class:`HassTrainingTimeTest` reads its group)."""
        return PLAIN_UNROLL

    @property
    def steps(self) -> int:
        return self.settings.train.ttt_steps

    @property
    def weights(self) -> list[float]:
        return step_weights(self.steps, self.settings.train.step_weight_decay)

    @property
    def topk_weight(self) -> float:
        return self.harmonized(self.settings).topk_weight

    @property
    def topk_term(self) -> RowTerm | None:
        """The top-K distillation term per row (K from the settings), None when its weight is 0 (not computed)."""
        hass = self.harmonized(self.settings)
        return partial(topk_distillation, k=hass.topk) if hass.topk_weight else None

    @classmethod
    def settings_problems(cls, settings: TrainSettings) -> list[str]:
        found = super().settings_problems(settings)
        loop, window, vocab = settings.train, settings.model.sliding_window, settings.model.draft_vocab_size
        if window is not None and not found and window <= loop.ttt_steps:
            found.append(
                f"model.sliding_window={window} must exceed train.ttt_steps={loop.ttt_steps}: step j's query sits "
                "j positions past its context, so a shorter window would hide every context key"
            )
        declared = variant_config(loop.algorithm)
        for flag, value in norm_flags(loop.algorithm, settings.model).items():
            if flag in declared and value != declared[flag]:
                found.append(
                    f"model.{flag}={str(value).lower()} with train.algorithm={loop.algorithm}: "
                    f"{display_name(loop.algorithm)} is EAGLE-3 with {flag}={str(declared[flag]).lower()}; leave "
                    f"model.{flag} unset (null) or train another algorithm"
                )
        hass = cls.harmonized(settings)
        if hass.topk_weight and vocab is not None and hass.topk > vocab:
            found.append(
                f"hass.topk={hass.topk} exceeds model.draft_vocab_size={vocab}: the top-K term ranks draft "
                "tokens; lower hass.topk or raise the draft vocabulary"
            )
        return found

    def build(
        self, verifier_config: dict[str, Any], features: Any, vocab: Any, head: TargetHead, fresh: bool
    ) -> tuple[Any, nn.Module]:
        settings, train = self.settings, self.settings.train
        config = draft_config(settings, verifier_config, features.aux_layer_ids, vocab.draft_vocab_size)
        draft = build_draft(settings, config, vocab, head)
        if settings.model.fc_init == "feature_rms" and fresh:
            scale_fc_by_feature_rms(draft, features.feature_rms().to(draft.fc.weight.device))
        if settings.model.warm_start == "top_layer" and fresh:
            calibrate_warm_start(draft, features.residual_rms())
        model = TTTDraft(
            draft,
            self.steps,
            detach_context=self.harmonized(settings).detach_context,
            attention_backend=train.attention_backend,
            chunk_size=train.attention_chunk,
        )
        return config, model

    def memory_terms(self, draft_config: Any, dtype: torch.dtype) -> MemoryTerms:
        """The unroll's flex attention pads every step's keys to one compiled shape (train.ttt_attention)."""
        train = self.settings.train
        padded = flex_padded_key_bytes(
            train.micro_batch_size, train.max_length, self.steps, draft_config, dtype, train.attention_backend
        )
        return MemoryTerms(padded_keys_bytes=padded)

    def meta_model(
        self,
        verifier_config: dict[str, Any],
        aux_layer_ids: list[int],
        draft_vocab_size: int,
        dtype: torch.dtype,
    ) -> tuple[Any, nn.Module]:
        settings = self.settings
        name = settings.verifier.name_or_path  # as written: naming it must not convert the embedded verifier
        config = recipe_draft_config(settings, verifier_config, aux_layer_ids, draft_vocab_size, name)
        with torch.device("meta"):
            draft = Eagle3DraftModel(config).to(dtype)
        model = TTTDraft(
            draft,
            self.steps,
            detach_context=self.harmonized(settings).detach_context,
            attention_backend="chunked",
            chunk_size=settings.train.attention_chunk,
        )
        return config, model

    def plan(self, batch: MicroBatch, loss_mask: torch.Tensor, head: TargetHead, seed: int) -> Plan:
        masks, needed = self.step_masks(batch, loss_mask, head, self.steps)
        return Plan(masks, needed, {}, training_loss_weight(batch))

    def loss(
        self,
        model: nn.Module,
        batch: MicroBatch,
        plan: Plan,
        head: TargetHead,
        trained: torch.Tensor,
        stats: StepStats,
    ) -> torch.Tensor:
        topk, topk_weight = self.topk_term, self.topk_weight
        logits = self.forward_logits(model, batch, plan)
        verifier_logits = target_logits(head, batch.last_hidden, plan.needed)
        loss = logits[0].new_zeros((), dtype=torch.float32)
        for j, weight in enumerate(self.weights):
            terms = self.terms(logits, verifier_logits, plan, j, topk)
            loss = loss + weight * (terms.ce + topk_weight * terms.topk) / trained[j].float()
            stats.add_terms(j, terms)
        return loss

    def forward_logits(self, model: nn.Module, batch: MicroBatch, plan: Plan) -> tuple[torch.Tensor, ...]:
        """The training forward: every step's logits at every position."""
        return model(batch.input_ids, batch.aux_hidden, batch.position_ids, batch.document_ids)

    def terms(
        self,
        logits: tuple[torch.Tensor, ...],
        verifier_logits: torch.Tensor,
        plan: Plan,
        step: int,
        topk: RowTerm | None,
    ) -> StepTerms:
        """Step ``step``'s loss sums (``topk``: the top-K term, or None) and top-1 hits from the training
        forward's logits."""
        return step_terms(logits[step], verifier_logits, plan.masks, step, topk, plan.loss_weight)

    def evaluate(
        self, model: nn.Module, batch: MicroBatch, head: TargetHead, stats: StepStats, steps: int
    ) -> None:
        topk = self.topk_term
        masks, needed = self.step_masks(batch, batch.loss_mask, head, steps, evaluating=True)
        verifier_logits = target_logits(head, batch.last_hidden, needed)
        logits = model(batch.input_ids, batch.aux_hidden, batch.position_ids, batch.document_ids, steps=steps)
        correct = []
        for j in range(steps):
            terms = step_terms(logits[j], verifier_logits, masks, j, topk)
            stats.add_terms(j, terms, batch.weight)
            correct.append(logits[j].argmax(-1) == masks.target_draft_id[j])
        stats.add_positions(masks, batch.weight)
        stats.add_chain(torch.stack(correct), masks.valid, batch.weight)


@register
class HassTrainingTimeTest(TrainingTimeTest):
    """HASS: the same unroll with its top-K distillation term and harmonized context, from its ``hass`` group."""

    algorithms = ("hass",)
    groups = {"hass": HassSettings}

    @classmethod
    def harmonized(cls, settings: TrainSettings) -> HassSettings:
        return settings.group("hass")
