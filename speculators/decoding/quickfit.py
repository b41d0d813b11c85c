"""A quickly self-distilled EAGLE-3 draft, for benchmarks and tests that need a draft which agrees with its
verifier when no trained one is at hand. It is NOT the training pipeline (train/ is): it fits a few hundred steps on
the verifier's own greedy continuations of the given prompts, so its acceptance on those prompts says nothing about
draft quality. It does exercise everything the engine relies on: aux features in vLLM's convention, the EAGLE
one-token shift, multi-step (TTT) unrolling with the draft's own hidden state, and a reduced draft vocabulary.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from speculators.decoding.engine import plain_generate
from speculators.format.config import Eagle3Config
from speculators.models.eagle3 import Eagle3DraftModel
from speculators.verifier import capture_aux_states, final_norm
from speculators.vocab import build_draft_vocab


@dataclass
class FitData:
    aux: list[torch.Tensor]  # per sequence [T, n_aux * H]
    tokens: list[torch.Tensor]  # per sequence [T]
    targets: list[torch.Tensor]  # per sequence [T]: the verifier's argmax at each position
    prompt_lengths: list[int]


@dataclass
class FitReport:
    steps: int
    seconds: float
    losses: list[float] = field(default_factory=list)
    draft_vocab_coverage: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "seconds": round(self.seconds, 2),
            "first_loss": self.losses[0] if self.losses else None,
            "last_loss": self.losses[-1] if self.losses else None,
            "draft_vocab_coverage": self.draft_vocab_coverage,
        }


@torch.no_grad()
def collect(
    verifier: nn.Module,
    prompts: Sequence[Sequence[int]],
    aux_layer_ids: Sequence[int],
    max_new_tokens: int,
    batch_size: int = 8,
) -> FitData:
    """Greedy continuations of ``prompts`` and the verifier's aux states / argmax over prompt + continuation."""
    data = FitData([], [], [], [])
    for start in range(0, len(prompts), batch_size):
        chunk = [list(p) for p in prompts[start : start + batch_size]]
        continuations = plain_generate(verifier, chunk, max_new_tokens=max_new_tokens).tokens
        for prompt, continuation in zip(chunk, continuations, strict=True):
            ids = torch.tensor([prompt + continuation], device=next(verifier.parameters()).device)
            with capture_aux_states(verifier, aux_layer_ids) as box:
                logits = verifier(input_ids=ids).logits
            data.aux.append(box["states"].aux[0].float().cpu())
            data.tokens.append(ids[0].cpu())
            data.targets.append(logits[0].argmax(-1).cpu())
            data.prompt_lengths.append(len(prompt))
    return data


def init_draft(
    verifier: nn.Module,
    name_or_path: str,
    data: FitData,
    draft_vocab_size: int,
    aux_layer_ids: Sequence[int] | None,
    num_layers: int = 1,
    seed: int = 0,
) -> tuple[Eagle3DraftModel, float]:
    """A draft shaped after the verifier; embedding copied (frozen), lm_head and final norm copied from the
    verifier's rows of the draft vocabulary (a strong start), vocabulary from the targets' frequencies."""
    torch.manual_seed(seed)
    config = Eagle3Config.from_verifier(
        verifier.config.to_dict(),
        name_or_path,
        draft_vocab_size=draft_vocab_size,
        aux_layer_ids=aux_layer_ids,
        num_layers=num_layers,
        torch_dtype="float32",
    )
    draft = Eagle3DraftModel(config)
    vocab_size = config.vocab_size
    counts = torch.zeros(vocab_size)
    for targets, length in zip(data.targets, data.prompt_lengths, strict=True):
        counts += torch.bincount(targets[max(length - 1, 0) :], minlength=vocab_size)[:vocab_size].float()
    vocab = build_draft_vocab(counts, config.draft_vocab_size, {"source": "quickfit"})
    draft.set_vocab(vocab.d2t, vocab.t2d)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(verifier.get_input_embeddings().weight.float().cpu())
        head = verifier.get_output_embeddings().weight.float().cpu()
        draft.lm_head.weight.copy_(head[vocab.target_ids])
        draft.norm.weight.copy_(final_norm(verifier).weight.float().cpu())
    return draft, float(vocab.provenance.get("assistant_token_coverage", 0.0))


def ttt_mask(length: int, step: int) -> torch.Tensor:
    """``[T, (step+1)·T]`` bool: at unroll step j, query t sees step-0 keys at s ≤ t−j and the step-i key at
    s = t−j+i — exactly what a chain rooted at t−j sees at inference."""
    t = torch.arange(length)
    blocks = [t[None, :] <= (t[:, None] - step)]
    for i in range(1, step + 1):
        blocks.append(t[None, :] == (t[:, None] - step + i))
    return torch.cat(blocks, dim=1)


def _batch(data: FitData, rows: list[int], target_to_draft: torch.Tensor) -> dict[str, torch.Tensor]:
    width = max(len(data.tokens[r]) for r in rows)
    n_aux = data.aux[rows[0]].shape[-1]
    aux = torch.zeros(len(rows), width, n_aux)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        length = len(data.tokens[r])
        aux[i, :length] = data.aux[r]
        tokens[i, : length - 1] = data.tokens[r][1:]  # position t reads token x_{t+1}
        label = target_to_draft[data.targets[r][1:]]  # and predicts the verifier's argmax at t+1
        first = max(data.prompt_lengths[r] - 2, 0)  # only targets inside the continuation
        labels[i, first : length - 1] = label[first:]
    return {"aux": aux, "tokens": tokens, "labels": labels}


def fit_steps(
    draft: Eagle3DraftModel,
    data: FitData,
    steps: int,
    ttt_steps: int = 3,
    lr: float = 3e-3,
    batch_size: int = 8,
    seed: int = 0,
) -> list[float]:
    """AdamW on the sum of the unrolled steps' cross-entropy against the verifier's argmax."""
    generator = torch.Generator().manual_seed(seed)
    target_to_draft = torch.full((draft.config.vocab_size,), -100, dtype=torch.long)
    target_to_draft[draft.draft_to_target(torch.arange(draft.config.draft_vocab_size))] = torch.arange(
        draft.config.draft_vocab_size
    )
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    draft.train()
    losses = []
    for _ in range(steps):
        rows = torch.randperm(len(data.tokens), generator=generator)[:batch_size].tolist()
        batch = _batch(data, rows, target_to_draft)
        loss = _unrolled_loss(draft, batch, ttt_steps)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    draft.eval()
    return losses


def _unrolled_loss(draft: Eagle3DraftModel, batch: dict[str, torch.Tensor], ttt_steps: int) -> torch.Tensor:
    tokens, labels = batch["tokens"], batch["labels"]
    length = tokens.shape[1]
    positions = torch.arange(length)[None].expand_as(tokens)
    hidden = draft.project_features(batch["aux"])
    past: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    total = hidden.new_zeros(())
    for step in range(ttt_steps):
        mask = ttt_mask(length, step)

        def attend(layer_idx, q, k, v, mask=mask):
            keys = torch.cat([pk for pk, _ in past.get(layer_idx, [])] + [k], dim=2)
            values = torch.cat([pv for _, pv in past.get(layer_idx, [])] + [v], dim=2)
            past.setdefault(layer_idx, []).append((k, v))
            return F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
            )

        logits, out = draft(tokens, hidden, positions, attend=attend)
        step_labels = labels.clone()
        step_labels[:, :step] = -100  # no chain can be rooted before position 0
        total = total + F.cross_entropy(
            logits.flatten(0, 1).float(), step_labels.flatten(), ignore_index=-100
        )
        hidden = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)  # step j at t reads h_{t-1}
    return total / ttt_steps


def fit_draft(
    verifier: nn.Module,
    prompts: Sequence[Sequence[int]],
    name_or_path: str = "verifier",
    draft_vocab_size: int = 1024,
    max_new_tokens: int = 64,
    steps: int = 200,
    ttt_steps: int = 3,
    lr: float = 3e-3,
    batch_size: int = 8,
    aux_layer_ids: Sequence[int] | None = None,
    seed: int = 0,
) -> tuple[Eagle3DraftModel, FitReport]:
    """Fit a draft on the verifier's greedy continuations of ``prompts``; returns it in the verifier's dtype."""
    start = time.perf_counter()
    dtype = next(verifier.parameters()).dtype
    if aux_layer_ids is None:
        from speculators.format.config import default_aux_layer_ids

        aux_layer_ids = default_aux_layer_ids(verifier.config.num_hidden_layers)
    data = collect(verifier, prompts, aux_layer_ids, max_new_tokens, batch_size)
    vocab_cap = min(draft_vocab_size, verifier.config.vocab_size)
    draft, coverage = init_draft(verifier, name_or_path, data, vocab_cap, aux_layer_ids, seed=seed)
    losses = fit_steps(draft, data, steps, ttt_steps, lr, batch_size, seed)
    report = FitReport(
        steps=steps, seconds=time.perf_counter() - start, losses=losses, draft_vocab_coverage=coverage
    )
    return draft.to(dtype), report
