"""A quickly self-distilled DFlash draft, for tests that need a block draft which agrees with its verifier (the
engine's acceptance checked against vLLM's, acceptance > 0 end to end). It is NOT a training pipeline: it fits a
few hundred steps on the verifier's own greedy continuations of the given prompts (collected as
:mod:`tests.support.quickfit` does), so its acceptance on those prompts says nothing about draft quality.

Each step takes one continuation and every anchor a in it: the block ``[x_a, mask …]`` at positions a, a+1, …
attends to the context features of positions < a (the model's own ``context_kv`` and ``block_attention``, the
pieces the engine drafts with) and slot s is scored against x_{a+s}, the verifier's greedy token there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from speculators.algorithms.dflash.model import DFlashDraftModel, block_attention
from speculators.format.config import default_aux_layer_ids
from speculators.verifier import final_norm
from tests.support.quickfit import FitData, collect, draft_vocabulary


def init_block_draft(
    verifier: nn.Module,
    name_or_path: str,
    data: FitData,
    draft_vocab_size: int,
    block_size: int,
    block_causal: bool,
    mask_token_id: int,
    aux_layer_ids: Sequence[int],
    seed: int = 0,
    model_class: type[DFlashDraftModel] = DFlashDraftModel,
    **config_fields: Any,
) -> DFlashDraftModel:
    """A block draft (``model_class``: DFlash's or DSpark's, whose own config fields, e.g. its Markov rank, come in
    ``config_fields``) over the continuations' most frequent tokens; embedding (frozen), lm_head rows and final
    norm copied from the verifier (a strong start)."""
    torch.manual_seed(seed)
    vocab_size = verifier.config.vocab_size
    vocab = draft_vocabulary(data, vocab_size, min(draft_vocab_size, vocab_size))
    config = model_class.config_class.from_verifier(
        verifier.config.to_dict(),
        name_or_path,
        mask_token_id=mask_token_id,
        draft_vocab_size=vocab.draft_vocab_size,
        aux_layer_ids=list(aux_layer_ids),
        block_size=block_size,
        block_causal=block_causal,
        torch_dtype="float32",
        **config_fields,
    )
    draft = model_class(config)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(verifier.get_input_embeddings().weight.float().cpu())
        draft.lm_head.weight.copy_(verifier.get_output_embeddings().weight.float().cpu()[vocab.target_ids])
        draft.norm.weight.copy_(final_norm(verifier).weight.float().cpu())
    return draft


def block_loss(draft: DFlashDraftModel, aux: torch.Tensor, tokens: torch.Tensor, first: int) -> torch.Tensor:
    """Mean cross-entropy of every block anchored at ``first .. T-2`` of one sequence against its next tokens.
    Each slot's previous token (what DSpark's Markov head and DFlash2's selector read; DFlash ignores it) is the
    data token before its target: teacher forcing, as the trainer does. A DFlash2 draft adds its selector's loss."""
    length, block = len(tokens), draft.config.block_size
    anchors = torch.arange(first, length - 1, device=tokens.device)  # the data's device (gpu_check: the GPU)
    positions = torch.arange(length, device=tokens.device)
    context = draft.project_context(aux[None])
    kv = draft.context_kv(context, positions[None])
    ids, block_positions = draft.block_inputs(tokens[anchors], anchors)
    visible = positions[None, None, :] < anchors[:, None, None]  # [N, 1, T]: context before the anchor
    window = draft.config.sliding_window
    if window is not None:
        visible = visible & (positions[None, None, :] > block_positions[:, :, None] - window)
    visible = visible.expand(len(anchors), block, length)
    count = len(anchors)

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        context_k, context_v = (t.expand(count, -1, -1, -1) for t in kv[layer])
        return block_attention(q, k, v, context_k, context_v, visible, draft.config.block_causal)

    previous = tokens[(block_positions - 1).clamp(0, length - 1)][:, 1:]
    hidden = draft.block_hidden(ids, block_positions, attend)[:, 1:]  # slot s predicts the token at a + s
    logits = draft.slot_logits(hidden, previous)
    target_positions = block_positions[:, 1:]
    inside = target_positions < length
    targets = tokens[target_positions.clamp(max=length - 1)]
    in_vocab = draft.t2d[targets]
    draft_ids = torch.cumsum(draft.t2d.long(), 0)[targets] - 1  # verifier id → draft id (t2d is sorted)
    keep = inside & in_vocab
    loss = nn.functional.cross_entropy(logits[keep], draft_ids[keep])
    if hasattr(
        draft, "selector_terms"
    ):  # DFlash2: its selector's K-way loss beside the unary one, as trained
        loss = loss + draft.selector_terms(logits, hidden, previous, targets)["selector_ce"][keep].mean()
    if hasattr(
        draft, "lattice_terms"
    ):  # LiLiCorr: its head's transition loss, anchored on the last context feature
        full = inside.all(-1)  # a block whose every slot has a target (the head scores the block as a whole)
        anchor = context[0, anchors - 1]
        ce = draft.lattice_terms(logits[full], hidden[full], anchor[full], targets[full])["lattice_ce"]
        loss = loss + ce.mean()
    return loss


def fit_block_draft(
    verifier: nn.Module,
    prompts: Sequence[Sequence[int]],
    name_or_path: str = "verifier",
    draft_vocab_size: int = 512,
    block_size: int = 4,
    block_causal: bool = True,
    mask_token_id: int = 3,
    max_new_tokens: int = 32,
    steps: int = 150,
    lr: float = 3e-3,
    seed: int = 0,
    model_class: type[DFlashDraftModel] = DFlashDraftModel,
    **config_fields: Any,
) -> tuple[DFlashDraftModel, list[float]]:
    """Fit a block draft (``model_class``, see :func:`init_block_draft`) on the verifier's greedy continuations of
    ``prompts``; returns it and the losses."""
    aux_layer_ids = default_aux_layer_ids(verifier.config.num_hidden_layers)
    data = collect(verifier, prompts, aux_layer_ids, max_new_tokens)
    draft = init_block_draft(
        verifier,
        name_or_path,
        data,
        draft_vocab_size,
        block_size,
        block_causal,
        mask_token_id,
        aux_layer_ids,
        seed,
        model_class,
        **config_fields,
    )
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    generator = torch.Generator().manual_seed(seed)
    draft.train()
    losses = []
    for _ in range(steps):
        row = int(torch.randint(len(data.tokens), (1,), generator=generator))
        # anchors from the last prompt token on: its block drafts the continuation's first tokens
        loss = block_loss(draft, data.aux[row], data.tokens[row], data.prompt_lengths[row] - 1)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    return draft.eval().requires_grad_(False).to(next(verifier.parameters()).dtype), losses
