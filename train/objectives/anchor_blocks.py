"""DFlash: anchor-block training from the EAGLE-3 offline features (no new capture).

Per micro batch, up to ``train.max_anchors`` positions t are sampled among those whose first draft token has a
target (a loss token x_{t+2} in the same document). Each sampled t anchors one block, exactly as decoding builds it
after the verifier confirmed x_0..x_t and emitted x_{t+1}:

    slot 0 = x_{t+1} at position pos_t + 1,   slots s >= 1 = mask_token_id at pos_t + 1 + s
    context = the draft's context K/V of positions 0..t of the same document (a sliding window if the layout has one)

Slot s = j + 1 is step j of the shared statistics: it targets the verifier's distribution at t+1+j (token
x_{t+2+j}). Every block of the micro batch is one forward (in anchor chunks: the scores of a chunk are
``anchors · slots · (L + slots)``, so memory is linear in the number of anchors).

Loss: soft cross-entropy (forward KL) per slot, weighted per position by ``train.position_weighting``:
``exp_decay`` (w_j = exp(-j / γ)) or ``dpace`` (each slot weighs the expected number of accepted tokens it
unlocks: w_j = Σ_{i ≥ j} Π_{m ≤ i} s_m with s_m = (1 - α)·exp(-CE_m) + α, detached). The normaliser is the global
batch's trained count per slot, as for EAGLE-3.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from speculators.format.dflash_config import DFlashConfig
from speculators.models.dflash import DFlashDraftModel, block_attention
from speculators.vocab import DraftVocab
from train.assemble import build_block_draft
from train.data import MicroBatch
from train.losses import StepMasks, StepTerms, soft_cross_entropy, step_masks, topk_distillation
from train.objectives import Objective, Plan, register
from train.step_stats import StepStats
from train.targets import TargetHead, needed_positions, target_draft_ids


class AnchorBlockDraft(nn.Module):
    """Wraps a block drafter (its parameters are ``draft.*``): one forward = every sampled anchor's block."""

    def __init__(self, draft: DFlashDraftModel, anchor_chunk: int) -> None:
        super().__init__()
        self.draft = draft
        self.anchor_chunk = anchor_chunk

    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        document_ids: torch.Tensor,
        rows: torch.Tensor,
        cols: torch.Tensor,
        slots: int,
    ) -> torch.Tensor:
        """Draft logits ``[N, slots, Vd]`` of the blocks anchored after positions ``(rows[n], cols[n])``."""
        draft = self.draft
        context = draft.project_context(aux_hidden.to(draft.fc.weight.dtype))
        context_kv = draft.context_kv(context, position_ids)
        length = input_ids.shape[1]
        columns = torch.arange(length, device=input_ids.device)
        window = draft.config.sliding_window
        out = []
        for start in range(0, rows.numel(), self.anchor_chunk):
            r, c = rows[start : start + self.anchor_chunk], cols[start : start + self.anchor_chunk]
            anchor_pos = position_ids[r, c] + 1
            block_ids, block_pos = draft.block_inputs(input_ids[r, c + 1], anchor_pos)
            block_ids, block_pos = block_ids[:, :slots], block_pos[:, :slots]
            # context columns <= t of the anchor's own document
            visible = (columns[None] <= c[:, None]) & (document_ids[r] == document_ids[r, c][:, None])
            visible = visible[:, None, :].expand(-1, slots, -1)
            if window is not None:
                visible = visible & (position_ids[r][:, None, :] > block_pos[:, :, None] - window)
            chunk_kv = [(k[r], v[r]) for k, v in context_kv]

            def attend(layer_idx: int, q, k, v, kv=chunk_kv, seen=visible):
                return block_attention(q, k, v, *kv[layer_idx], seen, draft.config.block_causal)

            out.append(draft(block_ids, block_pos, attend))
        return torch.cat(out) if out else context.new_zeros(0, slots, draft.config.draft_vocab_size)


def sample_anchors(
    valid_first: torch.Tensor, max_anchors: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``max_anchors`` positions where ``valid_first`` holds, uniformly without replacement (``seed``:
    reproducible, so a resumed run samples what it would have), in row-major order."""
    rows, cols = valid_first.nonzero(as_tuple=True)
    if rows.numel() > max_anchors:
        generator = torch.Generator().manual_seed(seed)
        keep = torch.randperm(rows.numel(), generator=generator)[:max_anchors].sort().values.to(rows.device)
        rows, cols = rows[keep], cols[keep]
    return rows, cols


def at_anchors(masks: StepMasks, rows: torch.Tensor, cols: torch.Tensor) -> StepMasks:
    """The step masks of the sampled anchors only, as ``[k, 1, N]`` (what the loss normaliser counts)."""
    return StepMasks(
        masks.valid[:, rows, cols][:, None],
        masks.trained[:, rows, cols][:, None],
        masks.target_draft_id[:, rows, cols][:, None],
    )


def dpace_weights(ce: torch.Tensor, trained: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE per-slot weights ``[N, k]`` from per-slot CE ``[N, k]`` (module docstring), detached."""
    with torch.no_grad():
        mask = trained.to(ce.dtype)
        smooth = torch.where(trained, (1.0 - alpha) * torch.exp(-ce) + alpha, torch.ones_like(ce))
        prefix = torch.cumprod(smooth, dim=-1) * mask
        return prefix.flip(-1).cumsum(-1).flip(-1) * mask


@register
class AnchorBlocks(Objective):
    algorithms = ("dflash",)
    config_class = DFlashConfig
    model_class = DFlashDraftModel

    @property
    def steps(self) -> int:
        return self.settings.model.block_size - 1

    @property
    def weights(self) -> list[float]:
        gamma = self.settings.train.decay_gamma
        return [math.exp(-j / gamma) for j in range(self.steps)]

    def build(
        self, verifier_config: dict[str, Any], features: Any, vocab: DraftVocab, head: TargetHead, fresh: bool
    ) -> tuple[Any, nn.Module]:
        draft = build_block_draft(
            self.settings, self.config_class, self.model_class, verifier_config, features, vocab, head
        )
        return draft.config, AnchorBlockDraft(draft, self.settings.train.anchor_chunk)

    # ---- training -------------------------------------------------------------------------------------------
    def plan(self, batch: MicroBatch, loss_mask: torch.Tensor, head: TargetHead, seed: int) -> Plan:
        needed = needed_positions(loss_mask)
        masks = step_masks(
            loss_mask,
            batch.document_ids,
            target_draft_ids(head, batch.last_hidden, needed),
            self.steps,
            self.settings.train.mask_out_of_vocab,
        )
        rows, cols = sample_anchors(masks.valid[0], self.settings.train.max_anchors, seed)
        return Plan(at_anchors(masks, rows, cols), needed, {"rows": rows, "cols": cols})

    def _terms(
        self, model: nn.Module, batch: MicroBatch, plan: Plan, head: TargetHead, steps: int, topk: int
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[StepTerms]]:
        """Block logits and, per step, the per-anchor CE ``[N]`` (0 where untrained) and the summed terms."""
        rows, cols = plan.extra["rows"], plan.extra["cols"]
        logits = model(
            batch.input_ids, batch.aux_hidden, batch.position_ids, batch.document_ids, rows, cols, steps + 1
        )
        masks = plan.masks
        per_anchor, terms = [], []
        length = batch.input_ids.shape[1]
        for j in range(steps):
            trained = masks.trained[j, 0]
            target_cols = (cols + 1 + j).clamp(max=length - 1)
            ce = logits.new_zeros(rows.numel(), dtype=torch.float32)
            top = logits.new_zeros((), dtype=torch.float32)
            if trained.any():
                verifier = head.draft_logits(batch.last_hidden[rows[trained], target_cols[trained]])
                ce = ce.masked_scatter(trained, soft_cross_entropy(logits[trained, j + 1], verifier))
                if topk:
                    top = topk_distillation(logits[trained, j + 1], verifier, topk).sum()
            with torch.no_grad():
                hits = (logits[:, j + 1].argmax(-1) == masks.target_draft_id[j, 0]) & masks.valid[j, 0]
            per_anchor.append(ce)
            terms.append(StepTerms(ce=ce.sum(), topk=top, correct=hits.sum().double()))
        return logits, per_anchor, terms

    def loss(
        self,
        model: nn.Module,
        batch: MicroBatch,
        plan: Plan,
        head: TargetHead,
        trained: torch.Tensor,
        stats: StepStats,
    ) -> torch.Tensor:
        train = self.settings.train
        _, per_anchor, terms = self._terms(model, batch, plan, head, self.steps, 0)
        ce = torch.stack(per_anchor, dim=-1)  # [N, k]
        if train.position_weighting == "dpace":
            weights = dpace_weights(ce, plan.masks.trained[:, 0].T, train.dpace_alpha)
        else:
            weights = ce.new_tensor(self.weights)[None].expand_as(ce)
        loss = (weights * ce / trained[None, : self.steps].float()).sum()
        for j, term in enumerate(terms):
            stats.add_terms(j, term)
        return loss

    # ---- validation -----------------------------------------------------------------------------------------
    def evaluate(
        self, model: nn.Module, batch: MicroBatch, head: TargetHead, stats: StepStats, steps: int
    ) -> None:
        """Every held-out position that starts a draft anchors a block of ``steps`` draft slots."""
        steps = min(steps, self.steps)
        needed = needed_positions(batch.loss_mask)
        masks = step_masks(
            batch.loss_mask,
            batch.document_ids,
            target_draft_ids(head, batch.last_hidden, needed),
            steps,
            self.settings.train.mask_out_of_vocab,
        )
        rows, cols = masks.valid[0].nonzero(as_tuple=True)
        plan = Plan(at_anchors(masks, rows, cols), needed, {"rows": rows, "cols": cols})
        logits, _, terms = self._terms(model, batch, plan, head, steps, 0)
        for j, term in enumerate(terms):
            stats.add_terms(j, term, batch.weight)
        stats.add_positions(plan.masks, batch.weight)
        correct = torch.stack(
            [logits[:, j + 1].argmax(-1) == plan.masks.target_draft_id[j, 0] for j in range(steps)]
        )
        stats.add_chain(correct[:, None], plan.masks.valid, batch.weight)
