"""Offline and online features are two implementations of one source: the same questions answered from shards
or from the verifier in the loop, and a collate function that DataLoader workers can take (no verifier in it)."""

from __future__ import annotations

import pickle

import pytest
import torch

from tests.train.conftest import compose, tiny_overrides
from tests.train.test_online import write_chats
from train.data_modes import SOURCES, open_features
from train.features import OfflineFeatures, OnlineFeatures, RowLayout
from train.objectives import train_settings
from train.settings import DATA_MODES
from train.streaming import StreamFeatures
from train.trainer import reset_distributed


@pytest.fixture
def accelerator():
    from accelerate import Accelerator

    yield Accelerator(cpu=True)
    reset_distributed()


def source_for(overrides: list[str], accelerator):
    from speculators.verifier import verifier_config_dict

    settings = train_settings(compose(overrides))
    layout = RowLayout.of(settings.train, accelerator.device)
    return open_features(settings, accelerator, layout, verifier_config_dict(settings.verifier.name_or_path))


def test_every_data_mode_settings_accept_opens_a_source():
    """The modes the settings validate against are exactly those a source serves: a mode added to one list only
    would pass validation and then fail with a KeyError at start-up (or never be reachable)."""
    assert set(SOURCES) == set(DATA_MODES)
    assert SOURCES["stream"] is SOURCES["cache-first-epoch"] is StreamFeatures
    assert (SOURCES["offline"], SOURCES["online"]) == (OfflineFeatures, OnlineFeatures)


def check_source(source, max_samples: int) -> None:
    assert len(source.train_set) == max_samples  # train.max_samples applied by the source
    assert len(pickle.dumps(source.collate)) < 2000  # workers get the packing rule, never a model
    items = [dict(source.train_set[i], noise_seed=0) for i in range(2)]
    batch = source.batch(source.collate(items), weight=0.5)
    assert batch.weight == 0.5 and batch.aux_hidden.shape[-1] == 3 * batch.last_hidden.shape[-1]
    assert batch.aux_hidden.device.type == "cpu" and batch.num_documents == 2
    evals = list(source.eval_batches())
    assert evals and all(b.input_ids.shape[0] <= 2 for b in evals)  # tiny recipes: micro batch 2
    assert source.feature_rms().shape == batch.aux_hidden.shape[-1:]
    head = source.target_head(torch.arange(8))
    assert head.draft_weight.shape[0] == 8


def test_offline_source_reads_the_shards(sharp_verifier, tiny_data, tmp_path, accelerator):
    source = source_for(
        tiny_overrides(sharp_verifier, tiny_data, tmp_path, "train.max_samples=4"), accelerator
    )
    assert isinstance(source, OfflineFeatures) and source.counts.sum() > 0
    check_source(source, 4)


def test_online_source_captures_with_the_verifier(tiny_llama_dir, tmp_path, accelerator):
    chats = write_chats(tmp_path / "chats.jsonl")
    overrides = [
        "recipe=tiny_eagle3",
        f"verifier.name_or_path={tiny_llama_dir}",
        f"data.source={chats}",
        "train.data_mode=online",
        "train.max_samples=3",
        "data.max_length=64",
        "train.max_length=64",
    ]
    source = source_for(overrides, accelerator)
    assert isinstance(source, OnlineFeatures) and source.provenance == {"source": "online"}
    check_source(source, 3)
    source.close()
    assert not hasattr(source, "verifier")


def test_start_up_statistics_fit_the_compiled_flex_layout(sharp_verifier, tiny_data, tmp_path, accelerator):
    """On CUDA the layout is fixed-width with at most ``micro_batch_size`` rows (compiled flex): the data-dependent
    inits (fc_init=feature_rms, warm_start=top_layer) read their 16 probe samples in micro batches, so they work
    under that layout and give the statistics of the free layout."""
    from dataclasses import replace

    source = source_for(tiny_overrides(sharp_verifier, tiny_data, tmp_path), accelerator)
    free_features, free_residual = source.feature_rms(), source.residual_rms()
    fixed = replace(source.layout, fixed_width=True, max_rows=source.settings.train.micro_batch_size)
    source.layout, source.collate = fixed, fixed.pack
    assert len(source.train_set) > source.settings.train.micro_batch_size  # the probe spans several batches
    torch.testing.assert_close(source.feature_rms(), free_features)
    assert source.residual_rms() == pytest.approx(free_residual, rel=1e-5)
