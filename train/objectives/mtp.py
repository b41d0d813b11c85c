"""MTP: fine-tuning the multi-token-prediction layer a Qwen3-Next verifier ships (speculators 0.9.0's forward).

The draft starts from the verifier's own MTP layer (its ``mtp.*`` tensors); embedding, ``lm_head`` and the final
norm are the verifier's, frozen. Every position t of a row drafts ``train.ttt_steps`` steps as speculators 0.9.0's
``MTPDraftModel.forward`` does: step 0 reads the verifier's (final-normed) last hidden state at t and token
x_{t+1}; step j reads the MTP output of step j-1 at t and token x_{t+1+j}. Every step keeps position t and attends
causally over the same step's states of its own document (0.9.0 runs each step as one causal pass over the
sequence). Step j is scored at t against the verifier's distribution at t+1+j (the token x_{t+2+j}, the target
0.9.0 takes from the data: on regenerated data, the verifier's own choice) and weighs beta**j normalised over the
steps (FastMTP's weights, 0.9.0's default beta 0.6: ``train.step_weight_decay``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from speculators.algorithms.mtp.config import MTPConfig
from speculators.algorithms.mtp.model import MTPDraftModel
from speculators.verifier import resolve_verifier_path
from train.data import MicroBatch
from train.losses import shift_left, step_terms, step_weights
from train.objectives import Objective, Plan, register
from train.settings import TrainSettings
from train.step_stats import StepStats
from train.targets import TargetHead, target_logits


def document_causal_attend(document_ids: torch.Tensor):
    """Causal attention inside each document of a packed row (padding, id -1, sees only itself)."""
    same = document_ids[:, :, None] == document_ids[:, None, :]
    length = document_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=document_ids.device).tril()
    visible = (same & causal) | torch.eye(length, dtype=torch.bool, device=document_ids.device)
    mask = visible[:, None]

    def attend(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

    return attend


class MTPUnroll(nn.Module):
    """Wraps an :class:`MTPDraftModel` (its parameters are ``draft.*``) with 0.9.0's recursive teacher-forced steps."""

    def __init__(self, draft: MTPDraftModel, steps: int) -> None:
        super().__init__()
        if steps < 1:
            raise ValueError(f"train.ttt_steps={steps}: MTP needs at least one step")
        self.draft = draft
        self.steps = steps

    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        document_ids: torch.Tensor,
        steps: int | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """k tensors ``[B, L, V]``: step j's logits at t (targets the verifier's distribution at t+1+j)."""
        steps = steps or self.steps
        dtype = self.draft.mtp_layers[0].input_proj.weight.dtype
        hidden = self.draft.project_features(aux_hidden.to(dtype))
        attend = document_causal_attend(document_ids)
        logits = []
        for j in range(steps):
            step_logits, hidden = self.draft(shift_left(input_ids, 1 + j), hidden, position_ids, attend)
            logits.append(step_logits)
        return tuple(logits)


@register
class MTPFineTune(Objective):
    algorithms = ("mtp",)

    @property
    def steps(self) -> int:
        return self.settings.train.ttt_steps

    @property
    def weights(self) -> list[float]:
        raw = step_weights(self.steps, self.settings.train.step_weight_decay)
        return [w / sum(raw) for w in raw]

    @classmethod
    def settings_problems(cls, settings: TrainSettings) -> list[str]:
        found = super().settings_problems(settings)
        if settings.model.draft_vocab_size is not None:
            found.append(
                f"model.draft_vocab_size={settings.model.draft_vocab_size} with train.algorithm=mtp: the MTP layer "
                "predicts over the verifier's whole vocabulary with the verifier's lm_head; set it to null"
            )
        return found

    def _config(self, verifier_config: dict[str, Any], aux_layer_ids: list[int], name: str) -> MTPConfig:
        config = MTPConfig.from_verifier(
            verifier_config, name, speculative_tokens=self.settings.export.speculative_tokens
        )
        if [int(i) for i in aux_layer_ids] != config.aux_layer_ids:
            raise ValueError(
                f"verifier.aux_layer_ids {list(aux_layer_ids)}: MTP reads the verifier's last hidden state, "
                f"{config.aux_layer_ids}; capture that (the recipe sets it)"
            )
        return config

    def build(
        self, verifier_config: dict[str, Any], features: Any, vocab: Any, head: TargetHead, fresh: bool
    ) -> tuple[Any, nn.Module]:
        path = resolve_verifier_path(self.settings.verifier.name_or_path)
        config = self._config(verifier_config, features.aux_layer_ids, path)
        if vocab.draft_vocab_size != config.vocab_size:
            raise ValueError(
                f"draft vocabulary {vocab.draft_vocab_size} != the verifier's {config.vocab_size}: MTP uses all of it"
            )
        torch.manual_seed(self.settings.seed)
        draft = MTPDraftModel.from_verifier(config, path)  # the verifier's own MTP layer: what is fine-tuned
        return config, MTPUnroll(draft, self.steps)

    def meta_model(
        self,
        verifier_config: dict[str, Any],
        aux_layer_ids: list[int],
        draft_vocab_size: int,
        dtype: torch.dtype,
    ) -> tuple[Any, nn.Module]:
        config = self._config(verifier_config, aux_layer_ids, self.settings.verifier.name_or_path)
        with torch.device("meta"):
            draft = MTPDraftModel(config).to(dtype)
        return config, MTPUnroll(draft, self.steps)

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
        logits = model(batch.input_ids, batch.aux_hidden, batch.position_ids, batch.document_ids)
        verifier_logits = target_logits(head, batch.last_hidden, plan.needed)
        loss = logits[0].new_zeros((), dtype=torch.float32)
        for j, weight in enumerate(self.weights):
            terms = step_terms(logits[j], verifier_logits, plan.masks, j)
            loss = loss + weight * terms.ce / trained[j].float()
            stats.add_terms(j, terms)
        return loss

    def evaluate(
        self, model: nn.Module, batch: MicroBatch, head: TargetHead, stats: StepStats, steps: int
    ) -> None:
        masks, needed = self.step_masks(batch, batch.loss_mask, head, steps, evaluating=True)
        verifier_logits = target_logits(head, batch.last_hidden, needed)
        logits = model(batch.input_ids, batch.aux_hidden, batch.position_ids, batch.document_ids, steps=steps)
        correct = []
        for j in range(steps):
            stats.add_terms(j, step_terms(logits[j], verifier_logits, masks, j), batch.weight)
            correct.append(logits[j].argmax(-1) == masks.target_draft_id[j])
        stats.add_positions(masks, batch.weight)
        stats.add_chain(torch.stack(correct), masks.valid, batch.weight)
