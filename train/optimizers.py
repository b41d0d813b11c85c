"""The optimizer, one builder per ``optim.name`` (recipes/optim/*.yaml): the trainer calls :func:`make_optimizer`
and never branches on the name.

* ``adamw``: torch AdamW over every trainable parameter; 1-D parameters (norms, biases) are not decayed.
* ``muon``: torch Muon over the 2-D hidden weight matrices, AdamW over the rest — the embedding, the LM head and
  any vocabulary-sized matrix (``lm_head``, ``embed_tokens``, DSpark's ``codebook``/``markov_w*``), norms, biases
  and degenerate ``[1, N]`` matrices. This is the split speculators 0.9.0 makes (its default optimizer). The two
  halves are one :class:`MuonWithAdamW` so accelerate, the lr schedule (:func:`train.assemble.set_lr`) and the
  checkpoints see a single optimizer, whose ``state_dict`` holds both halves' state for exact resume.

DeepSpeed ZeRO steps a client optimizer on flattened 1-D partitions, which Muon cannot orthogonalize, so
``optim=muon`` with DeepSpeed is refused with the settings (:meth:`train.settings.TrainSettings.combination_problems`);
DDP (``deepspeed=none``, any process count) runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from train.settings import OptimSettings

# 2-D parameters that still take AdamW: vocabulary-indexed matrices (the Muon convention speculators follows)
ADAMW_NAME_HINTS = ("embed_tokens", "lm_head", "codebook", "markov_w1", "markov_w2")


def takes_muon(name: str, param: torch.Tensor) -> bool:
    """A 2-D hidden weight matrix (both sides > 1) that is not vocabulary-indexed."""
    return param.ndim == 2 and min(param.shape) > 1 and not any(hint in name for hint in ADAMW_NAME_HINTS)


def adamw_groups(params: list[torch.Tensor], weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups of ``params``: matrices decayed, 1-D parameters (norms, biases) not."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}] if decay else []
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def adamw_optimizer(params: list[torch.Tensor], optim: OptimSettings) -> torch.optim.AdamW:
    """torch AdamW over ``params`` (:func:`adamw_groups`), in its fused kernel unless ``optim.fused`` is false or
    a parameter lives where torch has none (the dry run's meta device): on a CPU torch's default is a per-tensor
    Python loop, several times slower for a draft with a trained embedding or LM head, with the same update rule
    (bench/results/drafter_defaults.json measures each recipe's CPU per step with and without)."""
    fused = optim.fused if optim.fused is not None else all(p.device.type in FUSED_DEVICES for p in params)
    return torch.optim.AdamW(
        adamw_groups(params, optim.weight_decay),
        lr=optim.lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
        **({"fused": True} if fused else {}),
    )


FUSED_DEVICES = ("cpu", "cuda")  # where torch 2.13's AdamW has a fused kernel


def build_adamw(optim: OptimSettings, model: torch.nn.Module) -> torch.optim.Optimizer:
    return adamw_optimizer([p for _, p in trainable(model)], optim)


class MuonWithAdamW(torch.optim.Optimizer):
    """torch Muon and torch AdamW stepped together as one optimizer.

    The two inner optimizers own the update rules; this one owns their parameter groups (Muon's first, each
    tagged ``muon: True/False``) and one shared ``state``, so the base class's ``state_dict``/``load_state_dict``
    save and restore both halves, and ``set_lr`` reaches every group. After a load the inner optimizers are
    re-pointed at the restored groups and state (the base class replaces both objects)."""

    def __init__(self, muon: torch.optim.Muon | None, adamw: torch.optim.AdamW | None) -> None:
        self.halves = [half for half in (muon, adamw) if half is not None]
        if not self.halves:
            raise ValueError("optim=muon: the model has no trainable parameters")
        groups = []
        for half in self.halves:
            for group in half.param_groups:
                group["muon"] = isinstance(half, torch.optim.Muon)
                groups.append(group)
        super().__init__(groups, defaults={})
        self._share_with_halves()

    def _share_with_halves(self) -> None:
        start = 0
        for half in self.halves:
            count = len(half.param_groups)
            half.param_groups = self.param_groups[start : start + count]
            half.state = self.state
            start += count

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._share_with_halves()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for half in self.halves:
            half.step()
        return loss


def build_muon(optim: OptimSettings, model: torch.nn.Module) -> torch.optim.Optimizer:
    named = trainable(model)
    matrices = [p for name, p in named if takes_muon(name, p)]
    others = [p for name, p in named if not takes_muon(name, p)]
    muon_settings = optim.muon
    muon = (
        torch.optim.Muon(
            matrices,
            lr=optim.lr,
            weight_decay=muon_settings.weight_decay,
            momentum=muon_settings.momentum,
            nesterov=muon_settings.nesterov,
            ns_steps=muon_settings.ns_steps,
            adjust_lr_fn=muon_settings.adjust_lr_fn,
        )
        if matrices
        else None
    )
    adamw = adamw_optimizer(others, optim) if others else None
    return MuonWithAdamW(muon, adamw)


BUILDERS: dict[str, Callable[[OptimSettings, torch.nn.Module], torch.optim.Optimizer]] = {
    "adamw": build_adamw,
    "muon": build_muon,
}


def make_optimizer(optim: OptimSettings, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer ``optim.name`` names (checked with the settings against :data:`BUILDERS`)."""
    return BUILDERS[optim.name](optim, model)


__all__ = ["ADAMW_NAME_HINTS", "BUILDERS", "MuonWithAdamW", "make_optimizer", "takes_muon"]
