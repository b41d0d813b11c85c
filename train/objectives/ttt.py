"""EAGLE-3 and HASS: the k-step training-time-test unroll over every position (train/unroll.py).

Every position t of a row drafts: step j feeds token x_{t+1+j} and the draft's own hidden state from step j-1 (the
projected verifier feature at j=0) and is scored against the verifier's distribution at t+1+j. Step j weighs
``step_weight_decay**j``; HASS adds its top-K distillation term.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from speculators.models.eagle3 import Eagle3DraftModel
from train.assemble import (
    build_draft,
    calibrate_warm_start,
    draft_config,
    recipe_draft_config,
    scale_fc_by_feature_rms,
)
from train.data import MicroBatch
from train.losses import StepTerms, step_terms, step_weights
from train.memory_plan import flex_padded_key_bytes
from train.objectives import MemoryTerms, Objective, Plan, register
from train.settings import HassSettings, LoopSettings, TrainSettings
from train.step_stats import StepStats
from train.targets import TargetHead, target_logits
from train.unroll import TTTDraft


def hass_terms(train: LoopSettings) -> HassSettings:
    """``train.hass`` in force: HASS's own; EAGLE-3 trains the same unroll with the top-K term and the context
    detach off, whatever ``train.hass`` says."""
    return train.hass if train.algorithm == "hass" else HassSettings(topk_weight=0.0, detach_context=False)


@register
class TrainingTimeTest(Objective):
    algorithms = ("eagle3", "hass")
    sliding_window_layers = True

    @property
    def steps(self) -> int:
        return self.settings.train.ttt_steps

    @property
    def weights(self) -> list[float]:
        return step_weights(self.steps, self.settings.train.step_weight_decay)

    @property
    def topk_weight(self) -> float:
        return hass_terms(self.settings.train).topk_weight

    @property
    def topk(self) -> int:
        """K of the top-K term, 0 when the term is off (the losses skip it)."""
        hass = hass_terms(self.settings.train)
        return hass.topk if hass.topk_weight else 0

    @classmethod
    def settings_problems(cls, settings: TrainSettings) -> list[str]:
        found = super().settings_problems(settings)
        loop, window, vocab = settings.train, settings.model.sliding_window, settings.model.draft_vocab_size
        if window is not None and not found and window <= loop.ttt_steps:
            found.append(
                f"model.sliding_window={window} must exceed train.ttt_steps={loop.ttt_steps}: step j's query sits "
                "j positions past its context, so a shorter window would hide every context key"
            )
        hass = hass_terms(loop)
        if hass.topk_weight and vocab is not None and hass.topk > vocab:
            found.append(
                f"train.hass.topk={hass.topk} exceeds model.draft_vocab_size={vocab}: the top-K term ranks draft "
                "tokens; lower train.hass.topk or raise the draft vocabulary"
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
            detach_context=hass_terms(train).detach_context,
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
            detach_context=hass_terms(settings.train).detach_context,
            attention_backend="chunked",
            chunk_size=settings.train.attention_chunk,
        )
        return config, model

    def plan(self, batch: MicroBatch, loss_mask: torch.Tensor, head: TargetHead, seed: int) -> Plan:
        masks, needed = self.step_masks(batch, loss_mask, head, self.steps)
        return Plan(masks, needed, {})

    def loss(
        self,
        model: nn.Module,
        batch: MicroBatch,
        plan: Plan,
        head: TargetHead,
        trained: torch.Tensor,
        stats: StepStats,
    ) -> torch.Tensor:
        topk, topk_weight = self.topk, self.topk_weight
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
        topk: int,
    ) -> StepTerms:
        """Step ``step``'s loss sums and top-1 hits from the training forward's logits."""
        return step_terms(logits[step], verifier_logits, plan.masks, step, topk)

    def evaluate(
        self, model: nn.Module, batch: MicroBatch, head: TargetHead, stats: StepStats, steps: int
    ) -> None:
        topk = self.topk
        masks, needed = self.step_masks(batch, batch.loss_mask, head, steps)
        verifier_logits = target_logits(head, batch.last_hidden, needed)
        logits = model(batch.input_ids, batch.aux_hidden, batch.position_ids, batch.document_ids, steps=steps)
        correct = []
        for j in range(steps):
            terms = step_terms(logits[j], verifier_logits, masks, j, topk)
            stats.add_terms(j, terms, batch.weight)
            correct.append(logits[j].argmax(-1) == masks.target_draft_id[j])
        stats.add_positions(masks, batch.weight)
        stats.add_chain(torch.stack(correct), masks.valid, batch.weight)
