"""The linear-memory TTT attention equals the naive dense (k·L)-mask reference: values and gradients."""

from __future__ import annotations

import pytest
import torch

from tests.support.memory import peak_memory_of
from train.ttt_attention import (
    TTTAttention,
    chunked_ttt_attention,
    dense_ttt_attention,
    flex_ttt_attention,
    ttt_mask_dense,
)


def packed_document_ids(lengths_per_row: list[list[int]], total: int) -> torch.Tensor:
    rows = []
    for lengths in lengths_per_row:
        ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
        pad = total - ids.numel()
        rows.append(torch.cat([ids, torch.full((pad,), -1)]))
    return torch.stack(rows)


def random_steps(batch, heads, kv_heads, length, dim, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qs = [torch.randn(batch, heads, length, dim, generator=gen, requires_grad=True) for _ in range(steps)]
    ks = [torch.randn(batch, kv_heads, length, dim, generator=gen, requires_grad=True) for _ in range(steps)]
    vs = [torch.randn(batch, kv_heads, length, dim, generator=gen, requires_grad=True) for _ in range(steps)]
    return qs, ks, vs


def test_dense_mask_is_the_documented_pattern():
    doc = packed_document_ids([[2, 3]], 5)
    mask = ttt_mask_dense(doc, 3)[0]
    assert mask.shape == (5, 15)
    # step-0 block: causal within a document (position 2 starts document 1)
    assert mask[1, :5].tolist() == [True, True, False, False, False]
    assert mask[3, :5].tolist() == [False, False, True, True, False]
    # later blocks: only the query's own slot
    assert torch.equal(mask[:, 5:10], torch.eye(5, dtype=torch.bool))
    assert torch.equal(mask[:, 10:], torch.eye(5, dtype=torch.bool))


@pytest.mark.parametrize("chunk", [3, 7, 64])
def test_chunked_equals_dense_values_and_grads(chunk):
    steps, length = 3, 19
    doc = packed_document_ids([[5, 9, 3], [19]], length)
    qs, ks, vs = random_steps(2, 4, 2, length, 8, steps)

    def run(fn):
        outs = [fn(qs[j], ks[: j + 1], vs[: j + 1], doc) for j in range(steps)]
        loss = sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outs)
        grads = torch.autograd.grad(loss, qs + ks + vs)
        return outs, grads

    ref_out, ref_grads = run(dense_ttt_attention)
    out, grads = run(lambda q, k, v, d: chunked_ttt_attention(q, k, v, d, chunk_size=chunk))
    for a, b in zip(out, ref_out, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
def test_flex_forward_equals_dense_on_cpu():
    steps, length = 3, 40
    doc = packed_document_ids([[10, 30], [25, 15]], length)
    qs, ks, vs = ([t.detach() for t in ts] for ts in random_steps(2, 4, 2, length, 16, steps, seed=1))
    with torch.no_grad():
        for j in range(steps):
            ref = dense_ttt_attention(qs[j], ks[: j + 1], vs[: j + 1], doc)
            out = flex_ttt_attention(qs[j], ks[: j + 1], vs[: j + 1], doc, compile_backend=None)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            # keys zero-padded to the whole unroll (one key length for every step): the same values
            padded = flex_ttt_attention(qs[j], ks[: j + 1], vs[: j + 1], doc, steps, compile_backend=None)
            torch.testing.assert_close(padded, ref, atol=1e-5, rtol=1e-5)


def test_callback_tracks_steps_per_layer():
    length = 12
    doc = packed_document_ids([[12]], length)
    qs, ks, vs = random_steps(1, 2, 2, length, 4, 2)
    attend = TTTAttention(doc, backend="chunked", chunk_size=5)
    for j in range(2):
        for layer in (0, 1):
            out = attend(layer, qs[j], ks[j], vs[j])
            torch.testing.assert_close(out, dense_ttt_attention(qs[j], ks[: j + 1], vs[: j + 1], doc))


def test_chunked_memory_grows_linearly_dense_quadratically():
    """Peak live tensor bytes of forward+backward: doubling L doubles chunked, ~quadruples dense."""

    def peak(fn, length):
        doc = packed_document_ids([[length]], length)
        qs, ks, vs = random_steps(1, 2, 2, length, 8, 3)

        def work():
            outs = [fn(qs[j], ks[: j + 1], vs[: j + 1], doc) for j in range(3)]
            sum(o.sum() for o in outs).backward()

        return peak_memory_of(work)

    chunked = [
        peak(lambda q, k, v, d: chunked_ttt_attention(q, k, v, d, chunk_size=32), n) for n in (256, 512)
    ]
    dense = [peak(dense_ttt_attention, n) for n in (256, 512)]
    assert chunked[1] / chunked[0] < 2.3, chunked
    assert dense[1] / dense[0] > 3.3, dense


def tiny_draft(num_layers: int = 2):
    from speculators.algorithms.eagle3.config import Eagle3Config
    from speculators.algorithms.eagle3.model import Eagle3DraftModel
    from tests.support.verifiers import tiny_verifier_config

    verifier = tiny_verifier_config("llama", vocab_size=128).to_dict()
    config = Eagle3Config.from_verifier(verifier, "tiny", draft_vocab_size=64, num_layers=num_layers)
    torch.manual_seed(0)
    return Eagle3DraftModel(config)


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
@pytest.mark.parametrize("window", [None, 5])
def test_unrolled_draft_is_the_same_with_every_backend(window):
    """The whole TTT unroll of a 2-layer draft over a packed batch: chunked == dense (values and grads), and the
    flex path (forward, as evaluation runs it) == dense; also with layer 0 windowed and layer 1 full."""
    from speculators.format.config import FULL, SLIDING
    from train.unroll import TTTDraft

    draft = tiny_draft()
    if window is not None:
        draft.config.transformer_layer_config.update(layer_types=[SLIDING, FULL], sliding_window=window)
        assert draft.config.layer_windows == [window, None]
    length = 24
    doc = packed_document_ids([[10, 14], [20]], length)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (2, length), generator=gen)
    aux = torch.randn(2, length, 3 * 64, generator=gen)
    pos = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, -1).clone()

    def run(backend, grad=True):
        model = TTTDraft(draft, steps=3, attention_backend=backend, chunk_size=7)
        draft.zero_grad()
        with torch.set_grad_enabled(grad):
            logits = model(ids, aux, pos, doc)
            if not grad:
                return logits, None
            sum((o * o).mean() for o in logits).backward()
        return logits, [p.grad.clone() for p in draft.parameters() if p.requires_grad]

    dense, dense_grads = run("dense")
    chunked, chunked_grads = run("chunked")
    for a, b in zip(chunked, dense, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(chunked_grads, dense_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    flex, _ = run("flex", grad=False)
    for a, b in zip(flex, dense, strict=True):
        torch.testing.assert_close(a, b.detach(), atol=1e-5, rtol=1e-5)
