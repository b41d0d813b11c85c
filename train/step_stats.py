"""Step statistics: what the train and eval loops add up per TTT step, all-reduce once, and report.

Per step j: the soft-CE and top-K loss sums, the trained and valid position counts and the top-1 hits; per window:
the tokens and documents seen; and, for evaluation, the chain counts of the simulated acceptance length
(:func:`train.losses.acceptance_counts`). Every quantity is a SUM, so adding over micro-batches and all-reducing
over ranks gives the global batch's figures; :meth:`StepStats.loss` and the metric methods divide once at the end. Sums are float64
so that long windows lose nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from train.losses import StepMasks, StepTerms, acceptance_counts, acceptance_summary


class StepStats:
    """Sums over positions for ``steps`` TTT steps: add per micro-batch, :meth:`all_reduce` once, then report."""

    def __init__(self, steps: int, device: torch.device | str = "cpu") -> None:
        zeros = torch.zeros
        self.steps = steps
        self.ce = zeros(steps, dtype=torch.float64, device=device)
        self.topk = zeros(steps, dtype=torch.float64, device=device)
        self.trained = zeros(steps, dtype=torch.float64, device=device)
        self.valid = zeros(steps, dtype=torch.float64, device=device)
        self.correct = zeros(steps, dtype=torch.float64, device=device)
        self.chain = zeros(4, steps, dtype=torch.float64, device=device)  # see acceptance_counts
        self.tokens = zeros((), dtype=torch.float64, device=device)
        self.documents = zeros((), dtype=torch.float64, device=device)

    # ---- adding ----------------------------------------------------------------------------------------------
    def add_terms(self, step: int, terms: StepTerms, weight: float = 1.0) -> None:
        """One step's loss sums and top-1 hits (detached; ``weight`` counts duplicated evaluation samples)."""
        self.ce[step] += terms.ce.detach().double() * weight
        self.topk[step] += terms.topk.detach().double() * weight
        self.correct[step] += terms.correct.double() * weight

    def add_positions(self, masks: StepMasks, weight: float = 1.0) -> None:
        """The trained and valid positions of every step of one micro-batch."""
        counts = masks.counts().to(self.ce.device) * weight
        self.trained += counts[0]
        self.valid += counts[1]

    def add_chain(self, correct: torch.Tensor, valid: torch.Tensor, weight: float = 1.0) -> None:
        """Simulated-acceptance chain counts from bool ``[k, B, L]`` hits and valid positions."""
        self.chain += acceptance_counts(correct, valid).to(self.chain.device) * weight

    def add_batch(self, tokens: int, documents: int) -> None:
        self.tokens += tokens
        self.documents += documents

    # ---- combining -------------------------------------------------------------------------------------------
    def _fields(self) -> list[torch.Tensor]:
        return [
            self.ce,
            self.topk,
            self.trained,
            self.valid,
            self.correct,
            self.chain,
            self.tokens,
            self.documents,
        ]

    def all_reduce(self, accelerator) -> StepStats:
        """The sums over every rank, on this object's device (one collective: every rank must call it). No copy to
        the host here: the train step reduces its position counts every optimizer step and uses them on the
        device, so a host sync there would stall the GPU; reports convert when they read."""
        fields = self._fields()
        flat = torch.cat([f.reshape(-1) for f in fields])
        total = accelerator.reduce(flat, reduction="sum")
        out = StepStats(self.steps, total.device)
        offset = 0
        for mine, theirs in zip(fields, out._fields(), strict=True):
            theirs.copy_(total[offset : offset + mine.numel()].view_as(theirs))
            offset += mine.numel()
        return out

    # ---- reporting -------------------------------------------------------------------------------------------
    def per_step_ce(self) -> torch.Tensor:
        return self.ce / self.trained.clamp_min(1)

    def per_step_topk(self) -> torch.Tensor:
        return self.topk / self.trained.clamp_min(1)

    def loss(self, weights: list[float], topk_weight: float) -> float:
        """The objective the trainer minimises: Σ_j w_j (CE_j + topk_weight · topK_j), per trained position."""
        ce, topk = self.per_step_ce(), self.per_step_topk()
        return float(sum(w * (ce[j] + topk_weight * topk[j]) for j, w in enumerate(weights[: self.steps])))

    def per_step_metrics(self, prefix: str, with_topk: bool = False) -> dict[str, float]:
        """``{prefix}/ce_j`` and ``{prefix}/acc_j`` per step (and ``{prefix}/topk_j`` with ``with_topk``)."""
        ce, topk = self.per_step_ce(), self.per_step_topk()
        metrics: dict[str, float] = {}
        for j in range(self.steps):
            metrics[f"{prefix}/ce_{j}"] = float(ce[j])
            metrics[f"{prefix}/acc_{j}"] = float(self.correct[j] / self.valid[j].clamp_min(1))
            if with_topk:
                metrics[f"{prefix}/topk_{j}"] = float(topk[j])
        return metrics

    def acceptance(self, prefix: str) -> dict[str, Any]:
        """The simulated acceptance length, its ceiling on this data and the conditional per-step rates."""
        summary = acceptance_summary(self.chain.cpu())
        metrics: dict[str, Any] = {
            f"{prefix}/acceptance_length": summary["acceptance_length"],
            f"{prefix}/acceptance_length_max": summary["acceptance_length_max"],
        }
        for j, rate in enumerate(summary["acceptance_conditional"]):
            metrics[f"{prefix}/accept_rate_{j}"] = rate
        return metrics

    @property
    def drafts_started(self) -> int:
        return int(self.chain[3, 0])


__all__ = ["StepStats"]
