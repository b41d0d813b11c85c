"""A quickly self-distilled EAGLE-3 draft, for benchmarks and tests that need a draft which agrees with its
verifier when no trained one is at hand. It is NOT the training pipeline: it fits a few hundred steps on the
verifier's own greedy continuations of the given prompts, so its acceptance on those prompts says nothing about
draft quality. It trains with the trainer's own pieces — the TTT unroll (:class:`train.unroll.TTTDraft`), the
step masks and soft cross-entropy (:mod:`train.losses`) and the verifier targets (:mod:`train.targets`) — so there
is one TTT convention: aux features in vLLM's convention, the EAGLE one-token shift, k-step unrolling with the
draft's own hidden state, a reduced draft vocabulary.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from speculators.algorithms.eagle3.model import Eagle3DraftModel
from speculators.decoding.engine import plain_generate
from speculators.format.config import default_aux_layer_ids
from speculators.verifier import capture_aux_states, final_norm
from speculators.vocab import DraftVocab, build_draft_vocab
from train.losses import step_masks, step_terms
from train.targets import TargetHead, needed_positions, target_draft_ids, target_logits
from train.unroll import TTTDraft

# the short prompts a draft is fitted on and decoded with by the consumer tests (its greedy continuations are the data)
FIT_TEXTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Name three prime numbers.",
    "How do birds fly?",
    "Tell me a joke.",
    "Explain rain to a child.",
]


def fit_prompts(tokenizer) -> list[list[int]]:
    """``FIT_TEXTS`` as chat prompts in token ids (every engine of a comparison gets exactly the same input)."""
    prompts = []
    for text in FIT_TEXTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


@dataclass
class FitData:
    aux: list[torch.Tensor]  # per sequence [T, n_aux * H]
    tokens: list[torch.Tensor]  # per sequence [T]
    last_hidden: list[torch.Tensor]  # per sequence [T, H]: the verifier's last state before its final norm
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
    """Greedy continuations of ``prompts`` and the verifier's aux and last pre-norm states over them."""
    data = FitData([], [], [], [])
    for start in range(0, len(prompts), batch_size):
        chunk = [list(p) for p in prompts[start : start + batch_size]]
        continuations = plain_generate(verifier, chunk, max_new_tokens=max_new_tokens).tokens
        for prompt, continuation in zip(chunk, continuations, strict=True):
            ids = torch.tensor([prompt + continuation], device=next(verifier.parameters()).device)
            with capture_aux_states(verifier, aux_layer_ids) as box:
                verifier(input_ids=ids)
            data.aux.append(box["states"].aux[0].float().cpu())
            data.last_hidden.append(box["states"].last_prenorm[0].float().cpu())
            data.tokens.append(ids[0].cpu())
            data.prompt_lengths.append(len(prompt))
    return data


def loss_mask(data: FitData, row: int) -> torch.Tensor:
    """1 on the continuation (the tokens a draft is fitted to predict), 0 on the prompt."""
    mask = torch.zeros(len(data.tokens[row]), dtype=torch.long)
    mask[data.prompt_lengths[row] :] = 1
    return mask


def draft_vocabulary(data: FitData, vocab_size: int, draft_vocab_size: int) -> DraftVocab:
    """The most frequent continuation tokens, as the trainer counts its loss tokens."""
    counts = torch.zeros(vocab_size)
    for row, tokens in enumerate(data.tokens):
        counts += torch.bincount(tokens[loss_mask(data, row).bool()], minlength=vocab_size)[
            :vocab_size
        ].float()
    return build_draft_vocab(counts, draft_vocab_size, {"source": "quickfit"})


def init_draft(
    verifier: nn.Module,
    name_or_path: str,
    vocab: DraftVocab,
    aux_layer_ids: Sequence[int] | None,
    num_layers: int = 1,
    seed: int = 0,
    model_class: type[Eagle3DraftModel] = Eagle3DraftModel,
    config_keys: dict[str, Any] | None = None,
    **config_fields: Any,
) -> Eagle3DraftModel:
    """A draft shaped after the verifier; embedding copied (frozen), lm_head and final norm copied from the
    verifier's rows of the draft vocabulary (a strong start). ``model_class``: a draft of the EAGLE-3 family
    (P-EAGLE's, whose own config fields, e.g. its mask token, come in ``config_fields``). ``config_keys``: config
    attributes set after construction (a declared variant's, e.g. EAGLE-3.1's norm flags)."""
    torch.manual_seed(seed)
    config = model_class.config_class.from_verifier(
        verifier.config.to_dict(),
        name_or_path,
        draft_vocab_size=vocab.draft_vocab_size,
        aux_layer_ids=aux_layer_ids,
        num_layers=num_layers,
        torch_dtype="float32",
        **config_fields,
    )
    for key, value in (config_keys or {}).items():
        setattr(config, key, value)
    draft = model_class(config)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(verifier.get_input_embeddings().weight.float().cpu())
        head = verifier.get_output_embeddings().weight.float().cpu()
        draft.lm_head.weight.copy_(head[vocab.target_ids])
        draft.norm.weight.copy_(final_norm(verifier).weight.float().cpu())
    return draft


def batch_of(data: FitData, rows: list[int]) -> dict[str, torch.Tensor]:
    """Rows padded to the longest, one document each (document id -1 on padding), as the trainer's batches are."""
    width = max(len(data.tokens[r]) for r in rows)
    shape = (len(rows), width)
    device = data.tokens[rows[0]].device  # the data's device (scripts/gpu_check.py fits on the GPU)
    batch = {
        "input_ids": torch.zeros(shape, dtype=torch.long, device=device),
        "aux_hidden": torch.zeros(*shape, data.aux[rows[0]].shape[-1], device=device),
        "last_hidden": torch.zeros(*shape, data.last_hidden[rows[0]].shape[-1], device=device),
        "position_ids": torch.arange(width, device=device).expand(shape).clone(),
        "document_ids": torch.full(shape, -1, dtype=torch.long, device=device),
        "loss_mask": torch.zeros(shape, dtype=torch.long, device=device),
    }
    for i, r in enumerate(rows):
        length = len(data.tokens[r])
        batch["input_ids"][i, :length] = data.tokens[r]
        batch["aux_hidden"][i, :length] = data.aux[r]
        batch["last_hidden"][i, :length] = data.last_hidden[r]
        batch["document_ids"][i, :length] = 0
        batch["loss_mask"][i, :length] = loss_mask(data, r)
    return batch


def greedy_targets(verifier_logits: torch.Tensor) -> torch.Tensor:
    """Logits whose softmax is one-hot at the verifier's argmax. A tiny random verifier's distributions are nearly
    flat, so its soft targets teach almost nothing in a few steps; greedy acceptance only rewards the argmax."""
    one_hot = torch.full_like(verifier_logits, -1e4)
    return one_hot.scatter_(-1, verifier_logits.argmax(-1, keepdim=True), 0.0)


def unrolled_loss(model: TTTDraft, head: TargetHead, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The trainer's objective with step weights 1 and greedy targets: CE per step over its trained positions
    (the argmax is in the draft vocabulary there), averaged over the steps."""
    needed = needed_positions(batch["loss_mask"])
    verifier_logits = greedy_targets(target_logits(head, batch["last_hidden"], needed))
    draft_ids = target_draft_ids(head, batch["last_hidden"], needed)
    masks = step_masks(batch["loss_mask"], batch["document_ids"], draft_ids, model.steps, True)
    logits = model(batch["input_ids"], batch["aux_hidden"], batch["position_ids"], batch["document_ids"])
    trained = masks.counts()[0].clamp_min(1)
    total = sum(step_terms(logits[j], verifier_logits, masks, j).ce / trained[j] for j in range(model.steps))
    return total / model.steps


def fit_steps(
    draft: Eagle3DraftModel,
    head: TargetHead,
    data: FitData,
    steps: int,
    ttt_steps: int = 3,
    lr: float = 3e-3,
    batch_size: int = 8,
    seed: int = 0,
    unroll: type[TTTDraft] = TTTDraft,
) -> list[float]:
    """AdamW (cosine schedule, clipping 1.0) on the unrolled cross-entropy against the verifier's greedy tokens.
    ``unroll``: the trainer's wrapper that computes every step (P-EAGLE's ``ParallelDraft``: its K depths score
    the same targets as the TTT steps, train/objectives/peagle.py)."""
    generator = torch.Generator().manual_seed(seed)
    model = unroll(draft, ttt_steps, attention_backend="chunked")
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    model.train()
    losses = []
    for _ in range(steps):
        rows = torch.randperm(len(data.tokens), generator=generator)[:batch_size].tolist()
        loss = unrolled_loss(model, head, batch_of(data, rows))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    draft.eval()
    return losses


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
        aux_layer_ids = default_aux_layer_ids(verifier.config.num_hidden_layers)
    data = collect(verifier, prompts, aux_layer_ids, max_new_tokens, batch_size)
    vocab_size = verifier.config.vocab_size
    vocab = draft_vocabulary(data, vocab_size, min(draft_vocab_size, vocab_size))
    draft = init_draft(verifier, name_or_path, vocab, aux_layer_ids, seed=seed)
    head = TargetHead.from_model(verifier, vocab.target_ids.to(next(verifier.parameters()).device)).cpu()
    losses = fit_steps(draft, head, data, steps, ttt_steps, lr, batch_size, seed)
    report = FitReport(
        steps=steps,
        seconds=time.perf_counter() - start,
        losses=losses,
        draft_vocab_coverage=float(vocab.provenance.get("assistant_token_coverage", 0.0)),
    )
    return draft.to(dtype), report
