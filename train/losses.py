"""What a TTT unroll is scored by: soft cross-entropy (forward KL) per step, an objective's optional extra per-row
term (:data:`RowTerm`, summed as ``StepTerms.topk``), top-1 accuracy and the simulated acceptance length.

Alignment (docs/algorithms.md), per row of length L and drafting step j (0-based):

* the draft at position t sees feature g_t (step 0) or its own previous output (step j), and token x_{t+1+j};
* its target is the verifier's distribution at position u = t+1+j (which predicts x_{t+2+j});
* the position counts when x_{t+2+j} is a loss token (assistant content), lies in the same document as t and
  inside the row — ``valid``; EAGLE additionally drops positions whose verifier argmax is outside the draft vocab
  (``trained``: a draft cannot be taught a token it cannot propose).

Per-token loss weights (``loss_weight`` [B, L], data that up-weights the tokens a serving draft got wrong): the
position t of step j trains the prediction of x_{t+2+j}, so its CE and the objective's extra row term are multiplied
by ``loss_weight[t+2+j]`` (``shift_left(loss_weight, 2 + j)``, the same shift as the step's loss mask). The
normaliser stays the count of trained positions (the data's weights average 1 over its loss tokens), and only the
training loss is weighted: top-1 hits and the acceptance counts are not.

Normalisation: every term is a SUM over positions; the trainer divides by the number of trained positions of the
whole global batch (all ranks, all accumulation micro-batches), so 1 process and N processes compute the same loss
on the same global batch. Soft CE and forward KL differ by the target entropy only (same gradients); the loss is
reported as soft CE.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# an objective's extra loss term per selected row, from the draft's and the verifier's logits ``[N, V]`` → ``[N]``
# (the top-K distillation of train/objectives/eagle3.py); summed beside the CE, logged as the step's top-K term
RowTerm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def step_weights(steps: int, decay: float) -> list[float]:
    """``decay**j``: EAGLE-3 uses 0.8, speculators 1.0."""
    return [float(decay) ** j for j in range(steps)]


def shift_left(x: torch.Tensor, n: int, fill: int | float | bool = 0) -> torch.Tensor:
    """``out[:, t] = x[:, t + n]`` along dim 1, ``fill`` past the end."""
    if n == 0:
        return x
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


@dataclass
class StepMasks:
    """Bool ``[k, B, L]`` masks and the draft id of the verifier's argmax at each step's target position."""

    valid: torch.Tensor  # a loss token, same document, inside the row
    trained: torch.Tensor  # valid and (EAGLE) the verifier argmax is in the draft vocab
    target_draft_id: torch.Tensor  # long [k, B, L]: draft id of the verifier argmax at t+1+j, -1 outside

    def counts(self) -> torch.Tensor:
        """float64 ``[2, k]``: trained and valid positions per step (what the trainer all-reduces)."""
        return torch.stack([self.trained.sum((1, 2)), self.valid.sum((1, 2))]).double()


def step_masks(
    loss_mask: torch.Tensor,
    document_ids: torch.Tensor,
    verifier_draft_id: torch.Tensor,
    steps: int,
    mask_out_of_vocab: bool = True,
) -> StepMasks:
    """Masks of every TTT step from the row's loss mask, document ids and the verifier's argmax (as draft ids)."""
    valid, trained, target = [], [], []
    in_row = document_ids >= 0
    for j in range(steps):
        same_doc = shift_left(document_ids, 2 + j, fill=-2) == document_ids
        valid_j = shift_left(loss_mask.bool(), 2 + j, fill=False) & same_doc & in_row
        target_j = shift_left(verifier_draft_id, 1 + j, fill=-1)
        valid.append(valid_j)
        trained.append(valid_j & (target_j >= 0) if mask_out_of_vocab else valid_j)
        target.append(target_j)
    return StepMasks(torch.stack(valid), torch.stack(trained), torch.stack(target))


def soft_cross_entropy(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Per row ``-Σ_v p_v log q_v`` with p = softmax(target), q = softmax(draft); ``[N, V] → [N]``."""
    target = torch.softmax(target_logits.float(), dim=-1)
    return -(target * F.log_softmax(draft_logits.float(), dim=-1)).sum(-1)


@dataclass
class StepTerms:
    """Sums over one step's positions (loss terms keep their graph)."""

    ce: torch.Tensor
    topk: torch.Tensor  # the objective's extra term (:data:`RowTerm`), zero without one
    correct: torch.Tensor  # top-1 agreement with the verifier at valid positions


def target_weights(
    loss_weight: torch.Tensor | None, step: int, batch_idx: torch.Tensor, pos_idx: torch.Tensor
) -> torch.Tensor | None:
    """The weight of the token each selected position ``(batch_idx, pos_idx)`` of step ``step`` trains: the one at
    t+2+step (None without weights)."""
    if loss_weight is None:
        return None
    return shift_left(loss_weight.float(), 2 + step, fill=0.0)[batch_idx, pos_idx]


def step_terms(
    draft_logits: torch.Tensor,
    verifier_logits: torch.Tensor,
    masks: StepMasks,
    step: int,
    extra: RowTerm | None = None,
    loss_weight: torch.Tensor | None = None,
) -> StepTerms:
    """Loss sums for step ``step``: draft logits at t against the verifier's at t+1+step, on trained positions
    (``loss_weight``: the batch's per-token weights, see the module docstring; None: unweighted).

    Only the selected rows are materialised ([N, Vd]), never a shifted copy of the whole [B, L, Vd] target.
    """
    batch_idx, pos_idx = masks.trained[step].nonzero(as_tuple=True)
    draft_sel = draft_logits[batch_idx, pos_idx]
    target_sel = verifier_logits[batch_idx, pos_idx + 1 + step]
    with torch.no_grad():
        hits = (draft_logits.argmax(-1) == masks.target_draft_id[step]) & masks.valid[step]
    weights = target_weights(loss_weight, step, batch_idx, pos_idx)
    return _terms(draft_sel, target_sel, hits, extra, weights)


def element_terms(
    draft_logits: torch.Tensor,
    elements: torch.Tensor,
    verifier_logits: torch.Tensor,
    masks: StepMasks,
    step: int,
    extra: RowTerm | None = None,
    loss_weight: torch.Tensor | None = None,
) -> StepTerms:
    """:func:`step_terms` for draft logits ``[N, Vd]`` computed only at ``elements`` (flat ``row · L + t`` indices,
    sorted, covering every valid position of the step): the same sums, in the same order."""
    elements = elements.to(draft_logits.device)
    batch_idx, pos_idx = elements // masks.valid.shape[-1], elements % masks.valid.shape[-1]
    trained = masks.trained[step][batch_idx, pos_idx]
    draft_sel = draft_logits[trained]
    target_sel = verifier_logits[batch_idx[trained], pos_idx[trained] + 1 + step]
    with torch.no_grad():
        target = masks.target_draft_id[step][batch_idx, pos_idx]
        hits = (draft_logits.argmax(-1) == target) & masks.valid[step][batch_idx, pos_idx]
    weights = target_weights(loss_weight, step, batch_idx[trained], pos_idx[trained])
    return _terms(draft_sel, target_sel, hits, extra, weights)


def _terms(
    draft_sel: torch.Tensor,
    target_sel: torch.Tensor,
    hits: torch.Tensor,
    extra: RowTerm | None,
    weights: torch.Tensor | None = None,
) -> StepTerms:
    """The sums over the selected rows, each row's CE and extra term times its ``weights`` when given."""
    ce = soft_cross_entropy(draft_sel, target_sel)
    top = extra(draft_sel, target_sel) if extra is not None else None
    if weights is not None:
        ce = ce * weights
        top = top * weights if top is not None else None
    total = ce.sum()
    return StepTerms(
        ce=total, topk=top.sum() if top is not None else total.new_zeros(()), correct=hits.sum().double()
    )


def acceptance_counts(correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Chain counts for the simulated acceptance length, float64 ``[4, k]``.

    ``correct``/``valid``: bool ``[k, B, L]``. A position t starts a draft when step 0 is valid there; draft token
    j is accepted when steps 0..j are all valid and correct (the conditional, in-order rule of greedy
    verification). Rows: accepted[j] (drafts whose tokens 0..j were all accepted), eligible[j] (drafts whose
    tokens 0..j-1 were accepted and whose token j has a target: the denominator of the conditional rate),
    reachable[j] (drafts with targets for 0..j: the ceiling on this data), and the drafts started (column 0).
    """
    steps = correct.shape[0]
    accepted, eligible, reachable = [], [], []
    alive = valid[0].clone()
    ceiling = valid[0].clone()
    for j in range(steps):
        eligible.append((alive & valid[j]).sum().double())
        alive = alive & valid[j] & correct[j]
        ceiling = ceiling & valid[j]
        accepted.append(alive.sum().double())
        reachable.append(ceiling.sum().double())
    started = torch.zeros(steps, dtype=torch.float64, device=correct.device)
    started[0] = valid[0].sum().double()
    return torch.stack([torch.stack(accepted), torch.stack(eligible), torch.stack(reachable), started])


def acceptance_summary(counts: torch.Tensor) -> dict[str, float | list[float]]:
    """τ = 1 + accepted/drafts (a global ratio over positions), its ceiling, and the conditional per-position rates
    ``P(token j accepted | tokens 0..j-1 accepted, token j has a target)``."""
    accepted, eligible, reachable, started = counts[0], counts[1], counts[2], float(counts[3, 0])
    if started == 0:
        return {"acceptance_length": 1.0, "acceptance_length_max": 1.0, "acceptance_conditional": []}
    conditional = accepted / eligible.clamp_min(1)
    return {
        "acceptance_length": 1.0 + float(accepted.sum()) / started,
        "acceptance_length_max": 1.0 + float(reachable.sum()) / started,
        "acceptance_conditional": [round(float(x), 6) for x in conditional],
    }


__all__ = [
    "RowTerm",
    "StepMasks",
    "StepTerms",
    "acceptance_counts",
    "acceptance_summary",
    "element_terms",
    "shift_left",
    "soft_cross_entropy",
    "step_masks",
    "step_terms",
    "step_weights",
    "target_weights",
]
