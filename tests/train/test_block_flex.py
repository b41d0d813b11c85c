"""The block drafters' flex attention (train/anchor_attention.py) against their chunked kernel, on CPU.

torch 2.13 runs flex attention forward on CPU but has no CPU backward, so here: the mask_mod and its BlockMask
equal the chunked path's explicit mask (and a flipped intra-block causality does not), flex's forward through a
tiny DFlash equals the chunked forward, ``auto`` picks chunked on CPU and forcing flex for training fails with one
clear error, and the memory plan's flex bytes are linear in the anchors. Gradients (and training) of flex against
chunked are compared on a GPU by ``scripts/gpu_check.py`` (section ``block_flex_vs_chunked``).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

from speculators.algorithms.dflash.config import DFlashConfig
from speculators.algorithms.dflash.model import DFlashDraftModel
from tests.train.conftest import compose, tiny_overrides
from train.anchor_attention import BLOCK, anchor_mask_mod, flex_held_bytes, padded
from train.objectives.dflash import AnchorBlockDraft, context_visible, sample_anchors

SLOTS = 4
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def packed_rows(rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``document_ids``/``position_ids [rows, length]``: each row packs documents of different lengths."""
    generator = torch.Generator().manual_seed(1)
    cuts = torch.rand(rows, length, generator=generator) < 0.06
    cuts[:, 0] = False
    documents = cuts.long().cumsum(-1)
    starts = torch.zeros_like(documents)
    for row in range(rows):
        for doc in documents[row].unique():
            cols = (documents[row] == doc).nonzero().flatten()
            starts[row, cols] = cols[0]
    return documents, torch.arange(length)[None] - starts


def explicit_mask(rows, cols, documents, positions, block_pos, causal, window, anchors) -> torch.Tensor:
    """``[P·S, R·L + P·S]`` from the chunked path's own rule (:func:`context_visible` per anchor, tril / ones
    within a block); a padded anchor sees its own block only."""
    num_rows, length = documents.shape
    context = num_rows * length
    mask = torch.zeros(anchors * SLOTS, context + anchors * SLOTS, dtype=torch.bool)
    own = torch.ones(SLOTS, SLOTS, dtype=torch.bool)
    own = own.tril() if causal else own
    for n in range(anchors):
        q = slice(n * SLOTS, (n + 1) * SLOTS)
        mask[q, context + n * SLOTS : context + (n + 1) * SLOTS] = own
        if n < rows.numel():
            row = int(rows[n])
            seen = context_visible(
                cols[n : n + 1], documents[row], positions[row], block_pos[n : n + 1], window
            )
            mask[q, row * length : (row + 1) * length] = seen[0]
    return mask


@pytest.fixture(scope="module")
def anchored_batch():
    """Two packed rows of 200 tokens, 50 anchors padded to 64 (256 queries over 656 keys: several 128-blocks)."""
    documents, positions = packed_rows(2, 200)
    valid = torch.rand(2, 200, generator=torch.Generator().manual_seed(2)) > 0.2
    rows, cols = sample_anchors(valid, 50, seed=0)
    block_pos = positions[rows, cols][:, None] + 1 + torch.arange(SLOTS)[None]
    return rows, cols, documents, positions, block_pos, 64


@pytest.mark.parametrize(("causal", "window"), [(True, None), (False, None), (True, 9)])
def test_mask_mod_and_block_mask_are_the_chunked_rule(anchored_batch, causal, window):
    rows, cols, documents, positions, block_pos, anchors = anchored_batch
    expected = explicit_mask(rows, cols, documents, positions, block_pos, causal, window, anchors)

    def mask_of(causal_flag: bool):
        return anchor_mask_mod(
            padded(rows, anchors, -1), padded(cols, anchors, -1), documents, positions,
            padded(block_pos, anchors, 0), causal_flag, window,
        )  # fmt: skip

    queries, keys = expected.shape
    dense = create_mask(mask_of(causal), None, None, queries, keys, device="cpu")[0, 0]
    assert torch.equal(dense, expected)
    assert expected.sum(-1).min() >= 1  # no empty softmax row, padded anchors included
    # the BlockMask marks exactly the 128 x 128 blocks the explicit mask touches: the rows' context blocks of
    # other rows and the other anchors' block keys are skipped, not computed
    block_mask = create_block_mask(mask_of(causal), None, None, queries, keys, device="cpu")
    touched = torch.nn.functional.pad(expected, (0, -keys % BLOCK, 0, -queries % BLOCK))
    touched = touched.view(queries // BLOCK + (queries % BLOCK > 0), BLOCK, -1, BLOCK).any(3).any(1)
    assert torch.equal(block_mask.to_dense()[0, 0].bool(), touched)
    assert not touched.all()
    # control: the wrong intra-block causality is a different mask
    flipped = create_mask(mask_of(not causal), None, None, queries, keys, device="cpu")[0, 0]
    assert not torch.equal(flipped, expected)


@pytest.fixture(scope="module")
def tiny_block_draft(tiny_llama_dir):
    """A 2-layer DFlash (block 4) over the tiny verifier and a packed micro batch with 40 anchors."""
    verifier = json.loads((tiny_llama_dir / "config.json").read_text())
    config = DFlashConfig.from_verifier(
        verifier, str(tiny_llama_dir), mask_token_id=3, block_size=SLOTS, num_layers=2, torch_dtype="float32"
    )
    torch.manual_seed(0)
    draft = DFlashDraftModel(config)
    for name, param in draft.named_parameters():
        if name.endswith("norm.weight"):
            param.data.uniform_(0.5, 1.5)
    documents, positions = packed_rows(2, 96)
    n_aux = len(config.aux_layer_ids)
    inputs = (
        torch.randint(0, 100, (2, 96)),
        torch.randn(2, 96, n_aux * config.hidden_size),
        positions,
        documents,
    )
    valid = torch.zeros(2, 96, dtype=torch.bool)
    valid[:, : 96 - SLOTS] = True
    rows, cols = sample_anchors(valid, 40, seed=3)
    return draft, inputs, rows, cols


def block_logits(draft, inputs, rows, cols, backend: str, causal: bool, window: int | None):
    """Logits of every draft slot with the given intra-block causality and window (set on the config)."""
    draft.config.set_block_causal(causal)
    if window is not None:
        draft.config.transformer_layer_config["sliding_window"] = window
    model = AnchorBlockDraft(draft, anchor_chunk=16, attention_backend=backend, max_anchors=48)
    logits, _ = model(*inputs, rows, cols, SLOTS)
    return logits


@pytest.mark.parametrize(("causal", "window"), [(True, None), (False, None), (True, 11)])
def test_flex_forward_equals_the_chunked_forward(tiny_block_draft, causal, window):
    draft, inputs, rows, cols = tiny_block_draft
    with torch.no_grad():
        chunked = block_logits(draft, inputs, rows, cols, "chunked", causal, window)
        flex = block_logits(draft, inputs, rows, cols, "flex", causal, window)
        torch.testing.assert_close(flex, chunked, atol=2e-5, rtol=2e-5)
        # control: flex with the wrong intra-block causality is far from the chunked result
        wrong = block_logits(draft, inputs, rows, cols, "flex", not causal, window)
    assert (wrong - chunked).abs().max() > 1e-2


def test_flex_has_no_cpu_backward_in_this_torch():
    """Why training on CPU is chunked: flex attention refuses backward on CPU (torch 2.13). When a torch learns it,
    this fails, and the flex-vs-chunked gradient comparison can move from the GPU check into this file."""
    q = torch.randn(1, 1, 16, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex_attention(q, q, q).sum().backward()


def test_auto_trains_chunked_on_cpu_and_forced_flex_fails_clearly(tiny_block_draft):
    draft, inputs, rows, cols = tiny_block_draft
    draft.config.set_block_causal(True)
    auto = AnchorBlockDraft(draft, anchor_chunk=16, attention_backend="auto", max_anchors=48)
    chunked = AnchorBlockDraft(draft, anchor_chunk=16, attention_backend="chunked", max_anchors=48)
    logits = auto(*inputs, rows, cols, SLOTS)[0]
    assert torch.equal(logits, chunked(*inputs, rows, cols, SLOTS)[0])
    logits.square().mean().backward()
    assert draft.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    forced = AnchorBlockDraft(draft, anchor_chunk=16, attention_backend="flex", max_anchors=48)
    with pytest.raises(ValueError, match="flex attention cannot train on CPU"):
        forced(*inputs, rows, cols, SLOTS)


def test_forcing_flex_for_a_dflash_run_on_cpu_fails_at_start(sharp_verifier, tiny_data, tmp_path):
    from train.trainer import train

    run_dir = tmp_path / "flex"
    overrides = tiny_overrides(sharp_verifier, tiny_data, run_dir, "train.attention_backend=flex")
    overrides[0] = "recipe=tiny_dflash"
    with pytest.raises(ValueError, match="flex attention cannot train on CPU.*attention_backend=chunked"):
        train(compose(overrides), run_dir)
    assert not (run_dir / "checkpoints").exists()


def test_flex_held_bytes_double_with_the_anchors(tiny_llama_dir):
    """What flex keeps for backward: the context copy does not grow with the anchors, the per-anchor part doubles
    with them, exactly; the block mask's indices count 128-blocks of queries times keys (see the 8B plan test for
    their size)."""
    verifier = json.loads((tiny_llama_dir / "config.json").read_text())
    config = DFlashConfig.from_verifier(verifier, str(tiny_llama_dir), mask_token_id=3, block_size=16)
    held = {n: flex_held_bytes(2, 4096, n, 16, config, torch.bfloat16) for n in (256, 512, 1024)}
    assert held[256]["context"] == held[1024]["context"] > 0
    assert held[1024]["anchors"] == 2 * held[512]["anchors"] == 4 * held[256]["anchors"] > 0
    # 16 queries x 128 / 128 blocks x (2 x 4096 + 512 x 16) / 128 blocks x 4 tensors x 4 bytes
    assert held[512]["block_mask"] == 64 * 128 * 4 * 4


def test_the_dflash_8b_plan_counts_flex_linear_in_anchors():
    """The dry-run plan of dflash_qwen3_8b under flex (auto: the GPUs it plans for): flex's bytes are in the
    activation peak, and doubling ``max_anchors`` doubles the attention bytes that depend on the anchors (the
    increments of the whole activation peak double too: the chunked trace is linear as well)."""
    from tests.train.test_memory_plan import resolved
    from train.memory_plan import plan_memory

    plans = {n: plan_memory(resolved("dflash_qwen3_8b", f"block.max_anchors={n}")) for n in (128, 256, 512)}
    chunked = plan_memory(resolved("dflash_qwen3_8b", "train.attention_backend=chunked"))
    flex = plans[512]["flex_block_attention_bytes"]
    assert chunked["flex_block_attention_bytes"] == {} and flex["anchors"] > 0
    assert plans[512]["activation_peak_bytes"] - chunked["activation_peak_bytes"] == sum(flex.values())

    def anchor_part(n):
        parts = plans[n]["flex_block_attention_bytes"]
        return parts["anchors"] + parts["block_mask"]

    assert (
        2.0 <= anchor_part(512) / anchor_part(256) < 2.01
        and 2.0 <= anchor_part(256) / anchor_part(128) < 2.01
    )
    assert flex["block_mask"] < 0.002 * flex["anchors"]  # the quadratic-in-blocks part is negligible
    peaks = [plans[n]["activation_peak_bytes"] for n in (128, 256, 512)]
    assert 1.9 < (peaks[2] - peaks[1]) / (peaks[1] - peaks[0]) < 2.1, peaks


def test_compiled_flex_sees_one_shape_whatever_the_anchor_count(anchored_batch):
    """Micro batches with 50, 37 and 12 anchors (other documents, other rows) all pad to 64: with dynamo's
    recompile limit made fatal at one shape per function, compiled create_block_mask and flex_attention (the
    ``aot_eager`` CPU stand-in for inductor: same tracing and guards, see test_flex_shapes.py) never recompile, and
    give the eager result; anchors padded to another count are a new shape, which the limit makes an error."""
    import torch._dynamo

    from train.ttt_attention import limit_flex_recompiles

    rows, cols, documents, positions, block_pos, anchors = anchored_batch
    config = torch._dynamo.config
    saved = {
        key: getattr(config, key)
        for key in ("recompile_limit", "fail_on_recompile_limit_hit", "suppress_errors")
    }
    with config.patch(saved):  # restored on exit: the fatal limit is this test's only
        limit_flex_recompiles(1)
        try:
            for count, seed in ((50, 0), (37, 1), (12, 2)):
                attend, q, k, v = random_anchor_call(rows, cols, documents, positions, block_pos, count, seed)
                compiled = attend(anchors, "aot_eager")(0, q, k, v)
                torch.testing.assert_close(compiled, attend(anchors, None)(0, q, k, v), atol=1e-5, rtol=1e-5)
            with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
                attend(anchors + 1, "aot_eager")(0, q, k, v)
        finally:
            torch._dynamo.reset()
    assert {key: getattr(config, key) for key in saved} == saved


def random_anchor_call(rows, cols, documents, positions, block_pos, count: int, seed: int):
    """``count`` of the batch's anchors with random q/k/v and context: ``(attend(padded, backend), q, k, v)``."""
    from train.anchor_attention import flex_anchor_attention

    generator = torch.Generator().manual_seed(seed)
    keep = torch.randperm(rows.numel(), generator=generator)[:count].sort().values
    context = [tuple(torch.randn(2, 2, 2, 200, 8, generator=generator))]
    q = torch.randn(count, 4, SLOTS, 8, generator=generator)
    k, v = torch.randn(2, count, 2, SLOTS, 8, generator=generator)

    def attend(padded_anchors: int, backend: str | None):
        return flex_anchor_attention(
            context, rows[keep], cols[keep], documents, positions, block_pos[keep], True, None, padded_anchors,
            compile_backend=backend,
        )  # fmt: skip

    return attend, q, k, v
