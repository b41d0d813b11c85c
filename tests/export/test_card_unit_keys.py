"""The model card lists each algorithm's own config keys as its unit declares them (``Algorithm.card_keys``), and
the exporter rebuilds a config for config-less ZeRO shards through the unit the run's recorded algorithm names."""

from __future__ import annotations

import pytest

from speculators import algorithms
from speculators.export.exporter import infer_draft_config
from speculators.export.model_card import CardInfo, render_model_card
from speculators.format.checkpoint import read_config
from speculators.format.dflash_config import DSparkConfig


def test_a_dspark_card_shows_its_markov_rank(small_verifier_dir):
    config = DSparkConfig.from_verifier(
        read_config(small_verifier_dir),
        str(small_verifier_dir),
        mask_token_id=1,
        block_size=4,
        markov_rank=16,
    ).to_dict()
    card = render_model_card(CardInfo(config=config, verifier_ref="tiny", source="a test"))
    for key in algorithms.get("dspark").card_keys:
        assert f"| {key} | {config[key]} |" in card, key
    assert "| markov_rank | 16 |" in card and "norm_before_residual" not in card


def test_each_unit_declares_card_keys_its_config_class_writes():
    for name in algorithms.names():
        unit = algorithms.get(name)
        assert unit.card_keys and set(unit.card_keys) <= set(unit.config_class.__dataclass_fields__), name


def test_training_algorithms_resolve_to_their_unit_and_display_name():
    assert algorithms.trained_by("hass") is algorithms.get("eagle3")
    assert [algorithms.display_name(n) for n in ("hass", "eagle3", "peagle", "dspark")] == [
        "HASS",
        "EAGLE-3",
        "P-EAGLE",
        "DSpark",
    ]
    assert algorithms.display_name("medusa") == ""


def test_zero_shards_of_a_type_without_a_rebuild_are_explained(small_verifier_dir):
    recipe = {"train": {"algorithm": "dflash"}}
    with pytest.raises(ValueError, match="DFlash draft, whose config cannot be rebuilt"):
        infer_draft_config({}, read_config(small_verifier_dir), str(small_verifier_dir), recipe)
