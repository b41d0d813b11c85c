"""Batch plan and packing: the data position is the step number, packing keeps documents apart."""

from __future__ import annotations

import os
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch

from data_gen.batch_plan import BatchPlan
from data_gen.store import CorruptShardError, FeatureDataset
from tests.train.conftest import compose, tiny_overrides
from train.data import (
    assign_rows,
    eval_groups,
    noise_seed,
    pack_documents,
    row_buckets,
    run_loader,
)
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
    a = pack_documents([first], 8, True, noise_std=0.1).to("cpu").aux_hidden
    b = pack_documents([doc(2, 5), again], 8, True, noise_std=0.1).to("cpu").aux_hidden[:, 2:6]
    c = pack_documents([other], 8, True, noise_std=0.1).to("cpu").aux_hidden
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert 0.05 < float((a - 1.0).std()) < 0.2
    plain = pack_documents([doc(4, 1)], 8, True, noise_std=0.1).to("cpu").aux_hidden
    assert torch.equal(plain, torch.ones(1, 4, 6))


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
        assert len(trainer.features.train_set) == 4 and trainer.plan.num_samples == 4
        drawn = {
            i
            for step in range(trainer.plan.steps_per_epoch)
            for i in trainer.plan.micro_indices(0, step, 0, 0)
        }
        assert drawn == {0, 1, 2, 3}
        for i in drawn:
            assert torch.equal(trainer.features.train_set[i]["input_ids"], full[i]["input_ids"])
    finally:
        trainer.close()
        reset_distributed()


# ---- shards are hashed once per process; features cross the DataLoader in their storage dtype -----------------
def hash_log(monkeypatch, log: Path) -> None:
    """Record every sha256 of a shard (pid and file), in any process: DataLoader workers fork with it."""
    import data_gen.store as store

    real = store.sha256_file

    def counted(path, *args, **kwargs):
        with open(log, "a") as handle:
            handle.write(f"{os.getpid()} {Path(path).name}\n")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(store, "sha256_file", counted)


def two_epochs_through_workers(split_dir: Path, collate=None) -> list:
    dataset = FeatureDataset(split_dir, dequantize=False)
    plan = BatchPlan(len(dataset), micro_batch_size=2, grad_accum=1, world_size=1, seed=0)
    collate = collate or partial(pack_documents, max_length=128, packing=True, noise_std=0.1)
    loader = run_loader(dataset, plan, 0, 0, 2 * plan.steps_per_epoch, collate, num_workers=2)
    return list(loader)


def test_each_shard_is_hashed_once_per_process_not_per_worker(tiny_data, tmp_path, monkeypatch):
    log = tmp_path / "hashes.log"
    hash_log(monkeypatch, log)
    batches = two_epochs_through_workers(tiny_data / "train")
    assert len(batches) == 8  # 8 samples, micro batch 2, 2 epochs: both workers read both shards
    hashed = [line.split() for line in log.read_text().splitlines()]
    shards = sorted(p.name for p in (tiny_data / "train").glob("shard-*.safetensors"))
    assert sorted(name for _, name in hashed) == shards  # each shard once...
    assert {int(pid) for pid, _ in hashed} == {os.getpid()}  # ...by this process, before the workers started


def test_a_corrupted_shard_is_still_caught_before_the_workers(tiny_data, tmp_path):
    split = tmp_path / "train"
    shutil.copytree(tiny_data / "train", split)
    shard = split / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # same size, different bytes
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match="shard-00001.safetensors is corrupted"):
        two_epochs_through_workers(split)


def test_loader_batches_keep_the_storage_dtype_and_convert_on_the_device(tiny_data):
    """bf16 shards: the DataLoader's batches hold bf16 (half the shared memory of fp32); ``to(device)`` gives
    exactly the fp32 features, noise included, that dequantising in the workers gave."""
    collate = partial(pack_documents, max_length=128, packing=True, noise_std=0.1)
    stored = two_epochs_through_workers(tiny_data / "train", collate)
    assert {b.aux_hidden.dtype for b in stored} == {b.last_hidden.dtype for b in stored} == {torch.bfloat16}
    full = FeatureDataset(tiny_data / "train")  # dequantised to fp32 at read time, as the trainer used to
    plan = BatchPlan(len(full), micro_batch_size=2, grad_accum=1, world_size=1, seed=0)
    reference = list(run_loader(full, plan, 0, 0, 2 * plan.steps_per_epoch, collate))
    for item, old in zip(stored, reference, strict=True):
        new, old = item.to("cpu"), old.to("cpu")
        assert new.aux_hidden.dtype == torch.float32 and not new.noise
        assert torch.equal(new.aux_hidden, old.aux_hidden) and torch.equal(new.last_hidden, old.last_hidden)
        assert torch.equal(new.aux_hidden, new.to("cpu").aux_hidden)  # finished once: no second dose of noise


def test_fp8_features_travel_with_their_scales(tmp_path):
    from data_gen.store import Sample, finalize_split, write_shard

    gen = torch.Generator().manual_seed(0)
    rows = [
        Sample(
            f"s{i}",
            torch.arange(n),
            torch.ones(n, dtype=torch.bool),
            torch.randn(n, 6, generator=gen) * 30,
            torch.randn(n, 2, generator=gen),
        )
        for i, n in enumerate((5, 7, 4))
    ]
    write_shard(tmp_path / "train", 0, rows, 3, "fp8")
    finalize_split(tmp_path / "train", 1, {"aux_layer_ids": [1, 2, 3], "hidden_size": 2})
    raw = FeatureDataset(tmp_path / "train", dequantize=False)
    full = FeatureDataset(tmp_path / "train")
    batch = pack_documents([raw[i] for i in range(3)], 8, True)
    assert batch.aux_hidden.dtype == torch.float8_e4m3fn and batch.aux_scale.shape == (3, 7, 3)
    reference = pack_documents([full[i] for i in range(3)], 8, True).to("cpu")
    moved = batch.to("cpu")
    assert moved.aux_scale is None and moved.aux_hidden.dtype == torch.float32
    assert torch.equal(moved.aux_hidden, reference.aux_hidden)
    assert torch.equal(moved.last_hidden, reference.last_hidden)


def test_fixed_shapes_pad_rows_to_a_bucket():
    assert row_buckets(1) == [1] and row_buckets(4) == [1, 2, 4] and row_buckets(6) == [1, 2, 4, 6]
    three_rows = [doc(5, 1), doc(6, 2), doc(7, 3)]  # no two fit one row of 8
    batch = pack_documents(three_rows, max_length=8, packing=True, fixed_width=True, max_rows=4)
    assert batch.input_ids.shape == (4, 8)
    assert batch.document_ids[3].tolist() == [-1] * 8 and not batch.loss_mask[3].any()
    assert batch.num_tokens == 18 and batch.num_documents == 3
    two = pack_documents(three_rows[:2], max_length=8, packing=True, fixed_width=True, max_rows=4)
    assert two.input_ids.shape == (2, 8)
