"""Batch plan and packing: the data position is the step number, packing keeps documents apart."""

from __future__ import annotations

import pytest
import torch

from data_gen.store import FeatureDataset
from tests.train.conftest import compose, tiny_overrides
from train.data import BatchPlan, assign_rows, eval_groups, noise_seed, pack_documents
from train.trainer import Trainer, reset_distributed


def doc(n: int, value: int, hidden: int = 3) -> dict:
    return {
        "input_ids": torch.full((n,), value),
        "loss_mask": torch.ones(n, dtype=torch.bool),
        "aux_hidden": torch.full((n, 2 * hidden), float(value)),
        "last_hidden": torch.full((n, hidden), float(value)),
    }


def test_plan_same_global_batch_for_any_layout():
    one = BatchPlan(40, micro_batch_size=4, grad_accum=2, world_size=1, seed=3)
    two = BatchPlan(40, micro_batch_size=2, grad_accum=2, world_size=2, seed=3)
    assert one.steps_per_epoch == two.steps_per_epoch == 5
    for epoch in (0, 1):
        for step in range(5):
            a = sorted(i for acc in range(2) for i in one.micro_indices(epoch, step, acc, 0))
            b = sorted(
                i for acc in range(2) for r in range(2) for i in two.micro_indices(epoch, step, acc, r)
            )
            assert a == b
    assert one.order(0).tolist() != one.order(1).tolist()  # reshuffled each epoch, deterministically
    assert one.order(1).tolist() == BatchPlan(40, 4, 2, 1, seed=3).order(1).tolist()


def test_plan_refuses_too_little_data():
    with pytest.raises(ValueError, match="cannot fill one global batch"):
        BatchPlan(3, micro_batch_size=2, grad_accum=1, world_size=2, seed=0)


def test_packing_first_fit_with_document_ids_and_positions():
    batch = pack_documents([doc(5, 1), doc(4, 2), doc(3, 3), doc(6, 4)], max_length=8, packing=True)
    assert assign_rows([5, 4, 3, 6], 8, True) == [[0, 2], [1], [3]]
    assert batch.input_ids.shape == (3, 8)
    assert batch.document_ids[0].tolist() == [0] * 5 + [1] * 3
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert batch.document_ids[1].tolist() == [0] * 4 + [-1] * 4
    assert batch.aux_hidden[0, 6].tolist() == [3.0] * 6
    assert batch.num_tokens == 18 and batch.num_documents == 4
    padded = pack_documents([doc(5, 1), doc(12, 2)], max_length=8, packing=False)
    assert padded.input_ids.shape == (2, 8)  # truncated to max_length, one document per row
    assert padded.loss_mask[0].tolist() == [True] * 5 + [False] * 3


def test_feature_noise_depends_on_the_sample_only():
    first = dict(doc(4, 1), noise_seed=noise_seed(0, 0, 7))
    again = dict(doc(4, 1), noise_seed=noise_seed(0, 0, 7))
    other = dict(doc(4, 1), noise_seed=noise_seed(0, 1, 7))
    a = pack_documents([first], 8, True, noise_std=0.1).aux_hidden
    b = pack_documents([doc(2, 5), again], 8, True, noise_std=0.1).aux_hidden[:, 2:6]
    c = pack_documents([other], 8, True, noise_std=0.1).aux_hidden
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert 0.05 < float((a - 1.0).std()) < 0.2
    assert torch.equal(pack_documents([doc(4, 1)], 8, True, noise_std=0.1).aux_hidden, torch.ones(1, 4, 6))


def test_eval_groups_keep_ranks_in_lockstep():
    groups = [eval_groups(5, 2, 2, rank) for rank in range(2)]
    assert [g for g, _ in groups[0]] == [[0, 1], [4]]
    assert groups[1] == [([2, 3], 1.0), ([0, 1], 0.0)]  # a zero-weight filler keeps the ranks in step


def test_max_samples_trains_on_the_first_n_samples_only(sharp_verifier, tiny_data, tmp_path):
    # train.max_samples gives data-scaling curves: the plan covers exactly the first N samples of the split, and
    # every sample an epoch draws is one of them, unchanged.
    full = FeatureDataset(tiny_data / "train")
    assert len(full) > 4
    overrides = tiny_overrides(sharp_verifier, tiny_data, tmp_path / "run", "train.max_samples=4")
    try:
        trainer = Trainer(compose(overrides), tmp_path)
    except BaseException:
        reset_distributed()
        raise
    try:
        assert len(trainer.train_set) == 4 and trainer.plan.num_samples == 4
        drawn = {
            i
            for step in range(trainer.plan.steps_per_epoch)
            for i in trainer.plan.micro_indices(0, step, 0, 0)
        }
        assert drawn == {0, 1, 2, 3}
        for i in drawn:
            assert torch.equal(trainer.train_set[i]["input_ids"], full[i]["input_ids"])
    finally:
        trainer.close()
        reset_distributed()
