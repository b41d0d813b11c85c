"""Long context: packed rows of 16k-32k tokens cost memory linear in their length, sliding-window draft layers attend
inside their window in training exactly as the engine and vLLM do at inference, and the 32k recipe's plan splits its
activations across a Ulysses sequence-parallel group of 8 GPUs."""

from __future__ import annotations

import pytest
import torch

from speculators.algorithms.eagle3.config import Eagle3Config
from speculators.algorithms.eagle3.model import Eagle3DraftModel
from tests.support.memory import peak_memory_of
from tests.support.plans import recipe_plan, resolved_recipe
from tests.support.verifiers import tiny_verifier_config
from train.data import pack_documents
from train.memory_plan import GIB, LAYOUTS, hardware_verdict, plan_memory
from train.objectives import train_settings
from train.settings import SettingsError
from train.ttt_attention import TTTAttention, chunked_ttt_attention, dense_ttt_attention, ttt_mask_dense
from train.unroll import TTTDraft

DOCUMENT_LENGTHS = (300, 700, 1000, 2048, 450)  # packed first-fit, cycled until the row is full


def tiny_draft(window: int | None) -> Eagle3DraftModel:
    verifier = tiny_verifier_config("llama", vocab_size=128).to_dict()
    config = Eagle3Config.from_verifier(verifier, "tiny", draft_vocab_size=64, sliding_window=window)
    torch.manual_seed(0)
    return Eagle3DraftModel(config)


def packed_row(total_seq_len: int, hidden: int, aux_width: int):
    """One row of ``total_seq_len`` tokens packed from documents of the lengths above (the last one cut to fit)."""
    generator = torch.Generator().manual_seed(total_seq_len)
    samples, filled, index = [], 0, 0
    while filled < total_seq_len:
        length = min(DOCUMENT_LENGTHS[index % len(DOCUMENT_LENGTHS)], total_seq_len - filled)
        samples.append(
            {
                "input_ids": torch.randint(0, 128, (length,), generator=generator),
                "loss_mask": torch.ones(length, dtype=torch.bool),
                "aux_hidden": torch.randn(length, aux_width, generator=generator),
                "last_hidden": torch.randn(length, hidden, generator=generator),
            }
        )
        filled, index = filled + length, index + 1
    batch = pack_documents(samples, total_seq_len, packing=True, fixed_width=True)
    assert batch.input_ids.shape == (1, total_seq_len) and int(batch.document_ids.max()) == len(samples) - 1
    return batch


def unroll_peak(draft: Eagle3DraftModel, total_seq_len: int) -> int:
    """Peak live bytes of a 3-step TTT unroll (forward and backward) over one packed row."""
    model = TTTDraft(draft, 3, attention_backend="chunked", chunk_size=128)
    batch = packed_row(total_seq_len, draft.config.hidden_size, draft.fc.in_features)

    def work() -> None:
        logits = model(batch.input_ids, batch.aux_hidden, batch.position_ids, batch.document_ids)
        sum(step.logsumexp(-1).sum() for step in logits).backward()

    return peak_memory_of(work)


def test_packed_rows_cost_memory_linear_in_length():
    """Real CPU tensors: a tiny windowed draft (window 64, so a step takes seconds on a shared CPU) trained on packed
    rows of 4,096 and 8,192 tokens; doubling the row at most doubles the peak (plus 5%). The recipe-sized 16k and
    32k rows are the plan's test below (measured once by hand on real tensors too: 346 MB and 692 MB)."""
    draft = tiny_draft(window=64)
    half, full = unroll_peak(draft, 4096), unroll_peak(draft, 8192)
    assert 1.8 < full / half < 2.1, (half, full)


def test_the_32k_recipe_plan_is_linear_in_length():
    """The planner's count of the real kernels (tests/train/test_memory_plan.py checks it against real CPU steps)
    at the 32k recipe's shapes: from 16k to 32k tokens the step's activations double. (The quadratic control, the
    dense reference kernel, is test_ttt_attention.py's test_chunked_memory_grows_linearly_dense_quadratically.)"""
    half = recipe_plan("eagle3_llama8b_32k", "data.max_length=16384")
    full = recipe_plan("eagle3_llama8b_32k")
    ratio = full["activation_peak_bytes"] / half["activation_peak_bytes"]
    assert 1.9 < ratio <= 2.05, ratio


def test_the_32k_recipe_needs_its_sequence_parallel_group_on_8_gpus():
    """Ulysses splits each 32k row over 8 GPUs: the plan divides the per-GPU batch and activations by 8 and the
    recipe fits an 80 GB GPU; the same recipe without sequence parallelism does not."""
    plan = recipe_plan("eagle3_llama8b_32k")
    verdict = plan["hardware"]
    assert verdict["gpus"] == 8 and verdict["sequence_parallel"] == 8 and verdict["data_parallel"] == 1
    assert verdict["recipe_fits"]
    layout = verdict["recipe_layout"]
    per_sequence = plan["batch_bytes"] + plan["activation_peak_bytes"]
    static = plan["static_bytes_per_rank"][layout]["8"] + plan["frozen_bytes_per_rank"][layout]["8"]
    assert verdict["peak_bytes_per_rank"][layout] == static + per_sequence // 8
    alone = hardware_verdict(
        {**{k: verdict[k] for k in ("gpu", "gpus", "gpu_memory_gib")}, "sequence_parallel": 1},
        {key: plan["static_bytes_per_rank"][key]["8"] for key in LAYOUTS},
        {key: plan["frozen_bytes_per_rank"][key]["8"] for key in LAYOUTS},
        per_sequence,
        layout,
    )
    assert not alone["recipe_fits"] and alone["least_sharding_that_fits"] is None
    assert alone["peak_bytes_per_rank"][layout] / GIB > 79.6
    # today's trainer (no Ulysses yet) fits the recipe's layout on 8 GPUs at 8k-token rows
    today = recipe_plan("eagle3_llama8b_32k", "data.max_length=8192", "memory_plan.sequence_parallel=1")
    assert today["hardware"]["recipe_fits"]


def test_a_sequence_parallel_degree_must_divide_the_gpus():
    with pytest.raises(ValueError, match="must divide memory_plan.gpus"):
        plan_memory(resolved_recipe("eagle3_llama8b_32k", "memory_plan.sequence_parallel=3"))


# ---- sliding windows in training --------------------------------------------------------------------------------
def test_windowed_ttt_attention_is_the_dense_reference_with_the_window_mask():
    """Step j's query at t sees the step-0 keys s with t + j - window < s <= t of its own document, and its own
    slot's keys of steps 1..j; chunked (which reads only the window's keys) equals the dense reference, values and
    gradients, and the window changes the result (the control)."""
    length, window, steps = 40, 6, 3
    doc = torch.tensor([[0] * 25 + [1] * 15])
    gen = torch.Generator().manual_seed(0)
    qs = [torch.randn(1, 4, length, 8, generator=gen, requires_grad=True) for _ in range(steps)]
    ks = [torch.randn(1, 2, length, 8, generator=gen, requires_grad=True) for _ in range(steps)]
    vs = [torch.randn(1, 2, length, 8, generator=gen, requires_grad=True) for _ in range(steps)]
    mask = ttt_mask_dense(doc, steps, window)[0]
    t = 30  # document 1 starts at 25: step 2 sees 30 + 2 - 6 < s <= 30, i.e. 27..30
    assert mask[t, :length].nonzero().flatten().tolist() == [27, 28, 29, 30]
    assert mask[t, length:].nonzero().flatten().tolist() == [t, length + t]
    for j in range(steps):
        chunked = chunked_ttt_attention(qs[j], ks[: j + 1], vs[: j + 1], doc, chunk_size=7, window=window)
        dense = dense_ttt_attention(qs[j], ks[: j + 1], vs[: j + 1], doc, window)
        torch.testing.assert_close(chunked, dense)
        (grad_chunked,) = torch.autograd.grad(chunked.sum(), ks[0])
        (grad_dense,) = torch.autograd.grad(dense.sum(), ks[0])
        torch.testing.assert_close(grad_chunked, grad_dense)
    unwindowed = dense_ttt_attention(qs[2], ks, vs, doc)
    assert not torch.allclose(unwindowed, dense_ttt_attention(qs[2], ks, vs, doc, window))


def test_a_windowed_unroll_step_zero_is_the_inference_forward():
    """Step 0 of the TTT unroll is the draft's plain forward, which masks its windowed layer as vLLM does: the
    callback built from the config's layer_types, with no window argument passed by hand."""
    draft = tiny_draft(window=5).eval()
    assert draft.config.layer_windows == [5]
    length = 24
    ids = torch.randint(0, 128, (1, length))
    aux = torch.randn(1, length, draft.fc.in_features)
    positions = torch.arange(length)[None]
    with torch.no_grad():
        unrolled = TTTDraft(draft, 1, attention_backend="chunked", chunk_size=4)(
            ids, aux, positions, torch.zeros(1, length, dtype=torch.long)
        )[0]
        hidden = draft.project_features(aux)
        plain, _ = draft(torch.roll(ids, -1, 1), hidden, positions)
        full = tiny_draft(window=None).eval()
        unwindowed, _ = full(torch.roll(ids, -1, 1), full.project_features(aux), positions)
    torch.testing.assert_close(unrolled[:, :-1], plain[:, :-1])
    assert not torch.allclose(unrolled[:, :-1], unwindowed[:, :-1])


def test_window_settings_are_checked_before_anything_starts():
    config = resolved_recipe("eagle3_smollm2", "model.sliding_window=3", "train.ttt_steps=3")
    with pytest.raises(SettingsError, match="must exceed train.ttt_steps"):
        train_settings(config)
    with pytest.raises(SettingsError, match="EAGLE-3 and HASS only"):
        train_settings(resolved_recipe("tiny_dflash", "+model.sliding_window=64"))
    # P-EAGLE's parallel unroll passes no window
    with pytest.raises(SettingsError, match="EAGLE-3 and HASS only"):
        train_settings(resolved_recipe("tiny_peagle", "model.sliding_window=64"))
    attend = TTTAttention(torch.zeros(1, 4, dtype=torch.long), backend="chunked", windows=[2])
    q = torch.randn(1, 2, 4, 8)
    attend(0, q, q, q)
    attend(0, q, q, q)
    with pytest.raises(ValueError, match="would see no context key"):
        attend(0, q, q, q)
