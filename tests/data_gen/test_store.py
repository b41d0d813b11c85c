"""The feature store: lossless-enough round trips, fp8 halves the bytes, corruption and strangers are refused."""

from __future__ import annotations

import json

import pytest
import torch

from data_gen.store import (
    CorruptShardError,
    FeatureDataset,
    IncompatibleOutputError,
    Sample,
    check_or_write_identity,
    done_record,
    finalize_split,
    write_shard,
)

HIDDEN, NUM_AUX = 32, 3


def samples(count: int = 5, seed: int = 0, hidden: int = HIDDEN) -> list[Sample]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        length = 4 + 3 * i
        layer_scales = torch.tensor([1.0, 10.0, 100.0]).repeat_interleave(
            hidden
        )  # layers differ in magnitude
        out.append(
            Sample(
                sample_id=f"s{i}",
                input_ids=torch.randint(0, 1000, (length,), generator=generator),
                loss_mask=torch.rand(length, generator=generator) > 0.5,
                aux_hidden=torch.randn(length, NUM_AUX * hidden, generator=generator) * layer_scales,
                last_hidden=torch.randn(length, hidden, generator=generator) * 50,
            )
        )
    return out


def build(split_dir, storage_dtype: str, per_shard: int = 2, data=None):
    data = data or samples()
    shards = [data[i : i + per_shard] for i in range(0, len(data), per_shard)]
    for index, chunk in enumerate(shards):
        write_shard(split_dir, index, chunk, NUM_AUX, storage_dtype)
    return finalize_split(split_dir, len(shards), {"aux_layer_ids": [2, 3, 4], "hidden_size": HIDDEN})


@pytest.mark.parametrize(("storage_dtype", "tolerance"), [("bfloat16", 0.01), ("fp8", 0.07)])
def test_round_trip(tmp_path, storage_dtype, tolerance):
    data = samples()
    manifest = build(tmp_path / "train", storage_dtype, data=data)
    dataset = FeatureDataset(tmp_path / "train")
    assert len(dataset) == 5 and dataset.sample_ids == [s.sample_id for s in data]
    assert dataset.manifest["aux_layer_ids"] == [2, 3, 4] and manifest["num_tokens"] == sum(dataset.lengths())
    for item, original in zip(dataset, data, strict=True):
        assert item["sample_id"] == original.sample_id
        assert item["input_ids"].dtype == torch.long and torch.equal(item["input_ids"], original.input_ids)
        assert item["loss_mask"].dtype == torch.bool and torch.equal(item["loss_mask"], original.loss_mask)
        for key in ("aux_hidden", "last_hidden"):
            assert item[key].dtype == torch.float32 and item[key].shape == getattr(original, key).shape
            # per token and per aux layer: the small-magnitude layer keeps its precision next to the large one
            for piece, ref in zip(
                item[key].split(HIDDEN, -1), getattr(original, key).split(HIDDEN, -1), strict=True
            ):
                error = (piece - ref).norm(dim=-1) / ref.norm(dim=-1)
                assert float(error.max()) < tolerance


def test_fp8_halves_the_bytes(tmp_path):
    hidden = 576  # SmolLM2's width: per token 4*H values + 4 fp32 scales (fp8) + id + mask
    data = samples(8, hidden=hidden)
    bf16 = build(tmp_path / "bf16" / "train", "bfloat16", data=data)
    fp8 = build(tmp_path / "fp8" / "train", "fp8", data=data)
    naive = bf16["num_tokens"] * 4 * hidden * 2
    assert naive <= bf16["bytes"] < naive * 1.02  # ids, mask, offsets and headers are small
    assert fp8["bytes"] < 0.52 * bf16["bytes"]


def test_corrupted_or_missing_shard_is_detected_on_read(tmp_path):
    build(tmp_path / "train", "bfloat16")
    shard = tmp_path / "train" / "shard-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-10] ^= 0xFF  # one flipped byte in the last tensor's data
    shard.write_bytes(bytes(raw))
    dataset = FeatureDataset(tmp_path / "train")
    dataset[0]  # shard 0 is intact
    with pytest.raises(CorruptShardError, match=r"shard-00001.safetensors is corrupted.*rerun data_gen"):
        dataset[2]
    assert done_record(tmp_path / "train", 1) is None  # a resumed run rebuilds it
    shard.unlink()
    with pytest.raises(CorruptShardError, match="missing"):
        FeatureDataset(tmp_path / "train")[3]


def test_unfinished_split_is_explained(tmp_path):
    write_shard(tmp_path / "train", 0, samples(2), NUM_AUX, "bfloat16")
    with pytest.raises(FileNotFoundError, match="1 shard records exist.*rerun it to resume"):
        FeatureDataset(tmp_path / "train")
    with pytest.raises(RuntimeError, match=r"shards \[1\] are missing"):
        finalize_split(tmp_path / "train", 2, {})


def test_dataset_pickles_for_dataloader_workers(tmp_path):
    import pickle

    build(tmp_path / "train", "fp8")
    dataset = FeatureDataset(tmp_path / "train")
    first = dataset[0]
    clone = pickle.loads(pickle.dumps(dataset))
    torch.testing.assert_close(clone[0]["aux_hidden"], first["aux_hidden"])


def test_identity_mismatch_is_refused_and_nothing_changes(tmp_path):
    identity = {"verifier": {"fingerprint": "aaa"}, "aux_layer_ids": [2, 3, 4], "data": {"max_length": 128}}
    check_or_write_identity(tmp_path, identity)
    check_or_write_identity(tmp_path, json.loads(json.dumps(identity)))  # same: fine
    other = {"verifier": {"fingerprint": "bbb"}, "aux_layer_ids": [2, 3, 4], "data": {"max_length": 256}}
    before = (tmp_path / "run_identity.json").read_text()
    with pytest.raises(
        IncompatibleOutputError,
        match=r"data.max_length: stored 128 vs now 256; verifier.fingerprint: stored 'aaa' vs now 'bbb'",
    ):
        check_or_write_identity(tmp_path, other)
    assert (tmp_path / "run_identity.json").read_text() == before
    stray = tmp_path / "stray"
    write_shard(stray / "train", 0, samples(1), NUM_AUX, "bfloat16")
    with pytest.raises(IncompatibleOutputError, match="origin is unknown"):
        check_or_write_identity(stray, identity)
