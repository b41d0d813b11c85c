"""The verifier's distributions, recomputed from the stored pre-norm last states (offline) or taken from the
verifier in the loop (online) — through the verifier's own final norm and lm_head, nothing else.

Offline training never loads the verifier: only three tensors are read from its weight files (final norm,
lm_head — or the tied embedding — and the input embedding the draft copies), through :mod:`speculators.verifier`.
The targets a step needs are

* ``draft_logits``: verifier logits restricted to the draft vocabulary (the rows of lm_head at the draft's verifier
  ids; cheap even for a 128k vocabulary), softmaxed into the soft targets;
* ``argmax``: the verifier's argmax over its FULL vocabulary, computed in row chunks so the [T, V] logits never
  exist at once: the top-1 target for accuracy/acceptance and the EAGLE mask (argmax outside the draft vocab).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from speculators import families
from speculators.head_check import HeadAgreement, HeadProbe, check_head
from speculators.verifier import (
    LM_HEAD_NAMES,
    VERIFIER_EMBEDDING_NAMES,
    read_verifier_tensors,
    resolve_verifier_path,
)


class TargetHead(nn.Module):
    """Frozen verifier final norm + lm_head, mapped onto the draft vocabulary (``target_ids`` = verifier ids).

    The norm is the verifier's OWN module (its transformers class: Gemma 1-3 multiply by ``1 + w``, others by
    ``w``), never a re-implementation chosen by a family declaration, and :meth:`check` compares the whole head with
    the verifier's recorded logits before training starts (:mod:`speculators.head_check`)."""

    def __init__(
        self,
        norm: nn.Module,
        lm_head_weight: torch.Tensor,
        target_ids: torch.Tensor,
        logits_of: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        super().__init__()
        # the family's head transform (Granite's 1/logits_scaling, Gemma's soft cap): monotonic, so the argmax
        # is the raw product's, but the soft targets must be the verifier's own distribution
        self.logits_of = logits_of
        self.norm = norm
        self.register_buffer("weight", lm_head_weight.detach().clone(), persistent=False)
        self.register_buffer("target_ids", target_ids.to(torch.long), persistent=False)
        self.register_buffer("draft_weight", self.weight[self.target_ids].clone(), persistent=False)
        index = torch.full((lm_head_weight.shape[0],), -1, dtype=torch.long)
        index[self.target_ids] = torch.arange(len(self.target_ids))
        self.register_buffer("draft_index", index, persistent=False)  # verifier id -> draft id, -1 outside
        self.requires_grad_(False)
        self.full_vocab = len(self.target_ids) == lm_head_weight.shape[0]

    @classmethod
    def with_rms_norm(
        cls, norm_weight: torch.Tensor, lm_head_weight: torch.Tensor, eps: float, target_ids: torch.Tensor
    ) -> TargetHead:
        """A plain ``x·w`` RMSNorm head: for synthetic heads with no verifier behind them (memory plans, tests)."""
        norm = LlamaRMSNorm(norm_weight.shape[0], eps=eps).to(norm_weight.device)
        norm.weight.data.copy_(norm_weight)
        return cls(norm, lm_head_weight, target_ids)

    @classmethod
    def from_verifier_files(
        cls, name_or_path: str, verifier_config: dict[str, Any], target_ids: torch.Tensor
    ) -> TargetHead:
        """Load just the final norm and lm_head (or the tied embedding) of a verifier; the norm's module is the
        verifier's own class (:func:`verifier_norm_module`)."""
        family = families.of_config(verifier_config)
        text = family.text_config(verifier_config)
        norm_names = family.tensor_names("norm.weight")
        tied = bool(verifier_config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        # tied: the embedding is the head; untied but no lm_head stored: fall back to the embedding
        head_names = VERIFIER_EMBEDDING_NAMES if tied else LM_HEAD_NAMES + VERIFIER_EMBEDDING_NAMES
        tensors = read_verifier_tensors(name_or_path, {"norm": norm_names, "lm_head": head_names})
        lm_head = tensors.get("lm_head")
        if "norm" not in tensors or lm_head is None:
            raise KeyError(
                f"{name_or_path}: could not find {norm_names[0]} and {LM_HEAD_NAMES[0]} (or a tied "
                f"{VERIFIER_EMBEDDING_NAMES[0]}) in its weight files; is it a {family.display_name} causal LM?"
            )
        norm = verifier_norm_module(name_or_path, tensors["norm"])
        return cls(norm, lm_head.float(), target_ids, _head_transform(family, verifier_config))

    @classmethod
    def from_model(cls, model: nn.Module, target_ids: torch.Tensor) -> TargetHead:
        """The head of a loaded verifier (online training): a float32 copy of its own final norm module."""
        family = families.of_model(model)
        norm = copy.deepcopy(family.final_norm(model)).float().requires_grad_(False)
        transform = _head_transform(family, model.config.to_dict())
        return cls(norm, model.lm_head.weight.detach().float(), target_ids, transform)

    @torch.no_grad()
    def full_logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """Verifier logits over its WHOLE vocabulary, float32 ``[..., V]`` (a few positions: the head check)."""
        logits = (self.normed(last_hidden.to(self.weight.device)) @ self.weight.T).float()
        return logits if self.logits_of is None else self.logits_of(logits)

    def check(self, probe: HeadProbe, verifier: str, where: str) -> HeadAgreement:
        """Stop (:class:`speculators.head_check.HeadMismatchError`, one line) unless this head reproduces the
        verifier's own log-probabilities recorded in ``probe``."""
        return check_head(self.full_logits, probe, verifier, where)

    def normed(self, last_hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(last_hidden.to(self.norm.weight.dtype))

    @torch.no_grad()
    def draft_logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """Verifier logits over the draft vocabulary, float32 ``[..., draft V]``."""
        logits = (self.normed(last_hidden) @ self.draft_weight.T).float()
        return logits if self.logits_of is None else self.logits_of(logits)

    @torch.no_grad()
    def argmax(self, last_hidden: torch.Tensor, max_elements: int = 1 << 26) -> torch.Tensor:
        """The verifier's greedy token id over its full vocabulary, ``[...]`` long, in row chunks."""
        normed = self.normed(last_hidden)
        flat = normed.reshape(-1, normed.shape[-1])
        rows = max(1, max_elements // self.weight.shape[0])
        out = (
            torch.cat([(chunk @ self.weight.T).argmax(-1) for chunk in flat.split(rows)])
            if flat.numel()
            else (torch.zeros(0, dtype=torch.long, device=flat.device))
        )
        return out.view(normed.shape[:-1])


def verifier_norm_module(name_or_path: str, weight: torch.Tensor) -> nn.Module:
    """A float32 copy of the verifier's own final-norm module holding ``weight``: its transformers class is built
    from the verifier's config on the meta device (no memory, no weights read) and the norm alone is materialised.
    Whatever the family, the norm computes what the verifier computes (Gemma 1-3's ``1 + w`` included); a model
    transformers cannot build, or a norm holding more than its weight, is refused rather than guessed."""
    import transformers
    from transformers import AutoConfig

    path = resolve_verifier_path(name_or_path)
    config = AutoConfig.from_pretrained(path)
    family = families.of_config(config)
    try:
        with torch.device("meta"):
            model = getattr(transformers, family.auto_class).from_config(config)
        norm = family.final_norm(model)
    except (TypeError, ValueError, KeyError, AttributeError) as error:
        raise ValueError(
            f"{path}: cannot build the final norm of its {config.model_type!r} model with transformers "
            f"({error}); declare its family in speculators/families/ (docs/families.md)"
        ) from error
    held = sorted(norm.state_dict())
    if held != ["weight"]:
        raise ValueError(
            f"{path}: the final norm ({type(norm).__name__}) holds {held}, not just a weight; declare how its "
            "head is computed in a family module in speculators/families/ (docs/families.md)"
        )
    norm = norm.to_empty(device="cpu").float()
    norm.load_state_dict({"weight": weight.float()})
    return norm.requires_grad_(False)


def _head_transform(
    family: families.Family, verifier_config: dict[str, Any]
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The family's logit transform bound to this verifier's config, or None when it is the identity."""
    probe = torch.tensor([1.0, -2.0])
    if torch.equal(family.logits(probe, verifier_config), probe):
        return None
    return partial(family.logits, config=verifier_config)


@torch.no_grad()
def target_draft_ids(
    head: TargetHead, last_hidden: torch.Tensor, needed: torch.Tensor, within_draft_vocab: bool = False
) -> torch.Tensor:
    """Draft id of the verifier's full-vocab argmax at ``needed`` positions (-1 elsewhere or outside the draft
    vocab). The full-vocab matmul is the costliest target computation, so only positions whose NEXT token is a
    loss token — the only ones any TTT step uses as a target — pay for it.

    ``within_draft_vocab``: the verifier's argmax over the draft vocabulary instead (never -1 at a needed
    position), at a sixth of the cost for a 49k verifier with an 8k draft vocabulary: enough for training that
    does not drop out-of-vocab targets (``train.mask_out_of_vocab=false``), where the id only scores agreement;
    evaluation always takes the full one."""
    out = torch.full(needed.shape, -1, dtype=torch.long, device=needed.device)
    if needed.any():
        if within_draft_vocab:
            out[needed] = head.draft_logits(last_hidden[needed]).argmax(-1)
            return out
        if head.full_vocab:
            argmax = head.draft_logits(last_hidden[needed]).argmax(-1)
        else:
            argmax = head.argmax(last_hidden[needed])
        out[needed] = head.draft_index[argmax]
    return out


@torch.no_grad()
def target_logits(head: TargetHead, last_hidden: torch.Tensor, needed: torch.Tensor) -> torch.Tensor:
    """Verifier logits over the draft vocabulary at ``needed`` positions, zeros elsewhere, ``[B, L, Vd]``."""
    out = torch.zeros((*needed.shape, head.draft_weight.shape[0]), dtype=torch.float32, device=needed.device)
    if needed.any():
        out[needed] = head.draft_logits(last_hidden[needed])
    return out


def needed_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions u whose token u+1 is a loss token: the verifier distributions some TTT step trains on."""
    needed = torch.zeros_like(loss_mask, dtype=torch.bool)
    needed[:, :-1] = loss_mask[:, 1:].bool()
    return needed


__all__ = [
    "TargetHead",
    "verifier_norm_module",
    "needed_positions",
    "target_draft_ids",
    "target_logits",
]
