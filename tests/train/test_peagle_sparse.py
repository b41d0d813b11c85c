"""P-EAGLE's training forward computes depth d >= 1 only at the COD-sampled elements, and that changes nothing:
the objective's loss, its per-depth terms and every parameter's gradient equal the full unroll's (every depth at
every position). The control drops the earlier depths' diagonal keys from the sparse attention and must differ,
so the comparison can see a wrong context."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

import train.ttt_attention as ttt_attention
from speculators.algorithms.peagle.config import PEagleConfig
from speculators.algorithms.peagle.model import PEagleDraftModel
from tests.train.conftest import compose, tiny_overrides
from train.data import MicroBatch
from train.objectives import Plan, objective_for, train_settings
from train.objectives.peagle import ParallelDraft, chain_elements
from train.step_stats import StepStats
from train.targets import TargetHead
from train.trainer import train

DEPTHS, ROWS, LENGTH, VOCAB = 4, 2, 48, 64


@pytest.fixture(scope="module")
def setting(tiny_llama_dir):
    """The tiny_peagle objective at K = 4 with few anchors, a 2-layer draft (chunk 8: several query chunks per row),
    a random target head and a packed micro batch of two rows (three documents, padding at the end)."""
    overrides = [
        "recipe=tiny_peagle",
        f"verifier.name_or_path={tiny_llama_dir}",
        f"train.ttt_steps={DEPTHS}",
        "peagle.max_anchors=12",
        "logging=disabled",
    ]
    objective = objective_for(train_settings(compose(overrides)))
    verifier = json.loads((tiny_llama_dir / "config.json").read_text())
    config = PEagleConfig.from_verifier(
        verifier,
        str(tiny_llama_dir),
        mask_token_id=7,
        speculative_tokens=DEPTHS,
        num_layers=2,
        draft_vocab_size=VOCAB,
    )
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = ParallelDraft(PEagleDraftModel(config), DEPTHS, attention_backend="chunked", chunk_size=8)
    hidden = config.hidden_size
    head = TargetHead.with_rms_norm(
        torch.ones(hidden), torch.randn(VOCAB, hidden, generator=generator), 1e-6, torch.arange(VOCAB)
    )
    documents = torch.tensor([[0] * 20 + [1] * 28, [2] * 40 + [-1] * 8])
    positions = torch.cat([torch.arange(20), torch.arange(28)])[None].repeat(2, 1)
    positions[1] = torch.cat([torch.arange(40), torch.zeros(8, dtype=torch.long)])
    batch = MicroBatch(
        input_ids=torch.randint(0, config.vocab_size, (ROWS, LENGTH), generator=generator),
        loss_mask=(torch.rand(ROWS, LENGTH, generator=generator) > 0.2) & (documents >= 0),
        document_ids=documents,
        position_ids=positions,
        aux_hidden=torch.randn(ROWS, LENGTH, 3 * hidden, generator=generator),
        last_hidden=torch.randn(ROWS, LENGTH, hidden, generator=generator),
        num_documents=3,
    )
    return objective, model, head, batch


def loss_and_grads(objective, model, head, batch, plan):
    model.zero_grad(set_to_none=True)
    trained = plan.masks.trained.sum((1, 2)).double().clamp_min(1.0)
    stats = StepStats(DEPTHS)
    loss = objective.loss(model, batch, plan, head, trained, stats)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, stats


def test_sampled_depths_give_the_full_unrolls_loss_and_gradients(setting, monkeypatch):
    objective, model, head, batch = setting
    plan = objective.plan(batch, batch.loss_mask, head, seed=5)
    elements = plan.extra["elements"]
    # the sampled chains reach every depth, and are a small part of the full unroll
    counts = [int(e.numel()) for e in elements]
    assert all(count > 0 for count in counts) and counts[0] < ROWS * LENGTH / 3, counts
    assert counts == sorted(counts, reverse=True)

    sparse_loss, sparse_grads, sparse_stats = loss_and_grads(objective, model, head, batch, plan)
    dense_plan = Plan(plan.masks, plan.needed, {})  # no elements named: every depth at every position
    dense_loss, dense_grads, dense_stats = loss_and_grads(objective, model, head, batch, dense_plan)

    assert torch.allclose(sparse_loss, dense_loss, rtol=1e-5, atol=1e-6), (sparse_loss, dense_loss)
    assert torch.allclose(sparse_stats.ce, dense_stats.ce, rtol=1e-5)
    assert torch.equal(sparse_stats.correct, dense_stats.correct)
    assert set(sparse_grads) == set(dense_grads) and "draft.mask_hidden" in dense_grads
    for name, grad in dense_grads.items():
        scale = grad.abs().max().clamp_min(1e-6)
        assert (sparse_grads[name] - grad).abs().max() / scale < 1e-5, name

    # control: without the earlier depths' own-chain keys the sampled depths >= 2 see less and the loss moves
    monkeypatch.setattr(ttt_attention, "merge_diagonal", _drop_earlier_diagonal(ttt_attention.merge_diagonal))
    control_loss, _, control_stats = loss_and_grads(objective, model, head, batch, plan)
    assert torch.allclose(control_stats.ce[:2], dense_stats.ce[:2], rtol=1e-5)  # depths 0 and 1 untouched
    moved = (control_stats.ce[2:] - dense_stats.ce[2:]).abs() / dense_stats.ce[2:]
    assert bool((moved > 1e-4).all()), moved  # > 10x the equality's tolerance at depths 2 and 3
    assert not torch.allclose(control_loss, dense_loss, rtol=1e-4), (control_loss, dense_loss)


def _drop_earlier_diagonal(merge):
    """``merge_diagonal`` over the element's own key only (the keys of (t, 1..d-1) dropped)."""

    def merged(out0, lse0, q, keys, values, scale=None):
        return merge(out0, lse0, q, keys[-1:], values[-1:], scale)

    return merged


def test_chain_elements_close_the_sampled_set_under_prefixes():
    sampled = torch.zeros(DEPTHS, 1, 6, dtype=torch.bool)
    sampled[3, 0, 4] = True  # depth 3 at anchor 4 alone: depths 1 and 2 of that anchor are its diagonal keys
    sampled[1, 0, 1] = True
    assert [e.tolist() for e in chain_elements(sampled)] == [[1, 4], [4], [4]]


def test_sampled_training_resumes_exactly(sharp_verifier, tiny_data, tmp_path):
    """COD is seeded per micro batch and the sparse forward is a function of the plan: a run resumed from its
    step-4 checkpoint logs the same losses and ends on the same weights as the run that went straight through."""
    common = ("train.save_every=4", "train.keep_checkpoints=4", "train.eval_every=0", "train.grad_accum=2")

    def run(name: str, *extra: str) -> tuple[list[float], dict[str, torch.Tensor]]:
        overrides = tiny_overrides(sharp_verifier, tiny_data, tmp_path / name, *common, *extra)
        overrides[0] = "recipe=tiny_peagle"
        train(compose(overrides), tmp_path / name)
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses = [r["train/loss"] for r in map(json.loads, lines) if r["kind"] == "train"]
        final = tmp_path / name / "checkpoints" / "step-8" / "draft" / "model.safetensors"
        return losses, load_file(str(final))

    full_losses, full_weights = run("full", "train.epochs=4")
    start = tmp_path / "full" / "checkpoints" / "step-4"
    resumed_losses, resumed_weights = run("resumed", "train.epochs=4", f"train.resume={start}")
    assert len(full_losses) == 8 and resumed_losses == full_losses[4:]  # 2 steps per epoch (grad_accum 2)
    for name, weight in full_weights.items():
        assert torch.equal(weight, resumed_weights[name]), name


def test_a_depth_without_sampled_elements_still_runs_and_matches_the_full_unroll(setting):
    """Targets two apart leave no chain past depth 1 (depth d of anchor t needs the targets t+1..t+d+1): the deeper
    depths run empty (every parameter still takes part) and the loss is still the full unroll's."""
    objective, model, head, batch = setting
    every_other = batch.loss_mask.clone()
    every_other[:, 1::2] = False
    sparse_batch = replace(batch, loss_mask=every_other)
    plan = objective.plan(sparse_batch, sparse_batch.loss_mask, head, seed=5)
    counts = [int(e.numel()) for e in plan.extra["elements"]]
    assert counts[0] > 0 and counts[-1] == 0, counts

    sparse_loss, sparse_grads, _ = loss_and_grads(objective, model, head, sparse_batch, plan)
    dense_loss, dense_grads, _ = loss_and_grads(
        objective, model, head, sparse_batch, Plan(plan.masks, plan.needed, {})
    )
    assert torch.allclose(sparse_loss, dense_loss, rtol=1e-5, atol=1e-6), (sparse_loss, dense_loss)
    assert set(sparse_grads) == set(dense_grads)
