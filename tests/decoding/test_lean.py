"""The lean verifier forward (preallocated in-place KV cache, no HF module stack) computes what the HF forward
computes, through padded prefill, a branching tree verify, path compaction, row removal and cache growth, for Llama
and Qwen3: bit for bit on the HF weights (unpacked), and to fp32 rounding with the same argmax on its packed
(transposed, fused) weight copies, the CPU default."""

from __future__ import annotations

import pytest
import torch

from speculators.decoding.engine import VerifierRunner
from speculators.decoding.tree import DraftTree
from tests.support.tiny_models import random_draft, tiny_model

AUX = [1, 4, 8]  # id 8 = the last layer's output before the final norm (8-layer tiny models)


def pair(model, batch, packed=False):
    lean = VerifierRunner(model, batch, AUX, packed=packed)
    hf = VerifierRunner(model, batch, AUX, lean=False)
    assert lean.lean is not None and lean.lean.packed == packed and hf.lean is None
    return lean, hf


def same(lean, hf, got_lean, got_hf):
    assert torch.equal(lean.cache.valid, hf.cache.valid)
    if not lean.lean.packed:
        assert torch.equal(got_lean, got_hf)
        assert torch.equal(lean.aux, hf.aux)
        return
    torch.testing.assert_close(got_lean, got_hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lean.aux, hf.aux, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_lean.argmax(-1), got_hf.argmax(-1))


def step(runner, tokens, positions, local):
    return runner.forward(tokens, positions, local, torch.ones_like(tokens, dtype=torch.bool))


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_lean_forward_equals_hf_forward_on_a_batch_with_holes(arch, packed):
    model = tiny_model(arch=arch)
    prompts = [list(range(10, 17)), list(range(40, 43)), list(range(90, 101))]
    lean, hf = pair(model, len(prompts), packed)
    with torch.inference_mode():
        (a, _, valid), (b, _, _) = lean.prefill(prompts), hf.prefill(prompts)
        same(lean, hf, a, b)
        # a branching tree: root -> {1, 2}, 1 -> 3, 2 -> 4, 3 -> 5
        parents = torch.tensor([[-1, 0, 0, 1, 2, 3]]).expand(3, -1)
        depths = torch.tensor([[0, 1, 1, 2, 2, 3]]).expand(3, -1)
        tokens = torch.randint(0, 512, (3, 6), generator=torch.Generator().manual_seed(0))
        tree = DraftTree(tokens=tokens, parents=parents, depths=depths)
        positions = valid.long().sum(1, keepdim=True) + depths
        start = lean.cache.length
        same(
            lean,
            hf,
            step(lean, tokens, positions, tree.ancestor_mask()),
            step(hf, tokens, positions, tree.ancestor_mask()),
        )
        # rows keep different paths (one non-contiguous), so the caches get per-row holes
        path = torch.tensor([[0, 1, 3, 5], [0, 2, 4, 4], [0, 0, 0, 0]])
        keep = torch.tensor([[True] * 4, [True, True, True, False], [True, False, False, False]])
        for runner in (lean, hf):
            runner.cache.keep_path(start, path, keep)
        position = positions[:, :1] + keep.long().sum(1, keepdim=True)
        one = torch.ones(3, 1, 1, dtype=torch.bool)
        nxt = torch.tensor([[5], [6], [7]])
        same(lean, hf, step(lean, nxt, position, one), step(hf, nxt, position, one))
        rows = torch.tensor([0, 2])
        for runner in (lean, hf):
            runner.cache.select_rows(rows)
        same(
            lean,
            hf,
            step(lean, nxt[rows], position[rows] + 1, one[rows]),
            step(hf, nxt[rows], position[rows] + 1, one[rows]),
        )


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_lean_forward_equals_hf_forward_at_batch_one_across_cache_growth(packed):
    """Batch 1 takes the mask-free path for 1-token steps; a 250-token prompt makes the cache grow mid-decode."""
    model = tiny_model()
    lean, hf = pair(model, 1, packed)
    prompt = [list(torch.randint(0, 512, (250,), generator=torch.Generator().manual_seed(1)).tolist())]
    one = torch.ones(1, 1, 1, dtype=torch.bool)
    with torch.inference_mode():
        a, b = lean.prefill(prompt)[0], hf.prefill(prompt)[0]
        same(lean, hf, a, b)
        capacity = lean.cache.static.capacity
        for offset in range(12):
            token = a[:, -1].argmax(-1, keepdim=True)
            assert lean.cache.bool_mask(one) is None
            a = step(lean, token, torch.tensor([[250 + offset]]), one)
            b = step(hf, token, torch.tensor([[250 + offset]]), one)
            same(lean, hf, a, b)
        chain = torch.ones(1, 3, 3, dtype=torch.bool).tril()
        tokens = torch.tensor([[3, 4, 5]])
        positions = torch.tensor([[262, 263, 264]])
        same(lean, hf, step(lean, tokens, positions, chain), step(hf, tokens, positions, chain))
    assert lean.cache.static.capacity > capacity


def test_packed_copies_are_made_once_and_follow_weight_changes():
    """Runners share one packed copy per model; an in-place weight change (a new version) re-packs it."""
    model = tiny_model()
    first, second = VerifierRunner(model, 1, packed=True), VerifierRunner(model, 1, packed=True)
    assert first.lean.layers is second.lean.layers
    prompt = [[1, 2, 3, 4]]
    with torch.no_grad():
        model.model.layers[3].mlp.down_proj.weight.mul_(2.0)
    third = VerifierRunner(model, 1, packed=True)
    assert third.lean.layers is not first.lean.layers
    with torch.inference_mode():
        fresh = third.prefill(prompt)[0]
        reference = VerifierRunner(model, 1, lean=False).prefill(prompt)[0]
    torch.testing.assert_close(fresh, reference, rtol=1e-5, atol=1e-5)


def test_models_the_lean_forward_does_not_reproduce_keep_the_hf_forward():
    """A Llama with MLP biases is outside the lean forward: the engine runs the HF forward (aux states through
    hooks), and speculative greedy decoding still equals plain greedy, which equals ``generate``."""

    from speculators.decoding import DecodingConfig, SpeculativeDecoder, plain_generate
    from speculators.decoding.lean import lean_supported

    model = tiny_model(mlp_bias=True)
    assert not lean_supported(model) and VerifierRunner(model, 1).lean is None
    prompts = [list(range(20, 29)), list(range(60, 64))]
    plain = plain_generate(model, prompts, max_new_tokens=12).tokens
    hf = model.generate(torch.tensor([prompts[0]]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert hf[0, len(prompts[0]) :].tolist() == plain[0]
    decoder = SpeculativeDecoder(model, random_draft(model), DecodingConfig("chain", 3, max_new_tokens=12))
    assert decoder.generate(prompts).tokens == plain
