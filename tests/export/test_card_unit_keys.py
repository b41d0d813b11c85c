"""The model card lists each algorithm's own config keys as its unit declares them (``Algorithm.card_keys``), and
the exporter rebuilds a config for config-less ZeRO shards through the unit the run's recorded algorithm names."""

from __future__ import annotations

import pytest

from speculators import algorithms
from speculators.algorithms.dspark.config import DSparkConfig
from speculators.algorithms.eagle3.config import Eagle3Config
from speculators.export.exporter import infer_draft_config
from speculators.export.model_card import CardInfo, render_model_card
from speculators.format.checkpoint import read_config


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


def test_eagle31_is_a_variant_of_eagle3_and_its_card_names_it_from_the_config(small_verifier_dir):
    """EAGLE-3.1 trains and exports the eagle3 type; a config with both of its norm flags on is named EAGLE-3.1
    (also one another producer wrote, e.g. speculators 0.9.0's default EAGLE-3), one with either off EAGLE-3."""
    assert algorithms.trained_by("eagle31") is algorithms.get("eagle3")
    assert algorithms.display_name("eagle31") == "EAGLE-3.1"
    assert algorithms.variant_config("eagle31") == {"norm_before_fc": True, "norm_output": True}
    assert algorithms.variant_config("hass") == {} and algorithms.variant_config("eagle3") == {}
    base = Eagle3Config.from_verifier(read_config(small_verifier_dir), str(small_verifier_dir)).to_dict()
    for flags, name in (((True, True), "EAGLE-3.1"), ((True, False), "EAGLE-3"), ((False, False), "EAGLE-3")):
        config = {**base, "norm_before_fc": flags[0], "norm_output": flags[1]}
        card = render_model_card(CardInfo(config=config, verifier_ref="tiny", source="a test"))
        assert card.startswith(f"# {name} draft for ") and f"An {name} speculative-decoding draft" in card
        assert f"| norm_before_fc | {flags[0]} |" in card and f"| norm_output | {flags[1]} |" in card


@pytest.mark.parametrize(
    ("recipe", "flags"),
    [
        ({"train": {"algorithm": "eagle31"}, "model": {"norm_output": None}}, (True, True)),
        ({"train": {"algorithm": "eagle3"}}, (False, False)),
    ],
)
def test_zero_shards_of_an_eagle31_run_rebuild_its_flags(small_verifier_dir, recipe, flags):
    """Config-less ZeRO shards: norm_before_fc from the input norm's weight, norm_output (no tensor of its own)
    from the recipe, else from what the recorded train.algorithm declares (EAGLE-3.1: true)."""
    from speculators.algorithms.eagle3.model import Eagle3DraftModel

    verifier = read_config(small_verifier_dir)
    config = Eagle3Config.from_verifier(verifier, str(small_verifier_dir), draft_vocab_size=64)
    config.norm_before_fc, config.norm_output = flags
    tensors = Eagle3DraftModel(config).state_dict()
    rebuilt = infer_draft_config(tensors, verifier, str(small_verifier_dir), recipe)
    assert (rebuilt["norm_before_fc"], rebuilt["norm_output"]) == flags


def test_zero_shards_of_a_type_without_a_rebuild_are_explained(small_verifier_dir):
    recipe = {"train": {"algorithm": "dflash"}}
    with pytest.raises(ValueError, match="DFlash draft, whose config cannot be rebuilt"):
        infer_draft_config({}, read_config(small_verifier_dir), str(small_verifier_dir), recipe)


def test_each_card_takes_the_article_its_unit_declares(small_verifier_dir):
    """ "An MTP draft", "A DFlash draft": the article is the unit's (spoken names: em-tee-pee), not the first letter."""
    from speculators.algorithms.dflash.config import DFlashConfig

    assert algorithms.get("mtp").article == "An" and algorithms.get("dflash").article == "A"
    assert algorithms.get("peagle").article == "A" and algorithms.get("eagle3").article == "An"
    config = DFlashConfig.from_verifier(
        read_config(small_verifier_dir), str(small_verifier_dir), mask_token_id=1, block_size=4
    ).to_dict()
    card = render_model_card(CardInfo(config=config, verifier_ref="tiny", source="a test"))
    assert "\nA DFlash speculative-decoding draft" in card
    unit = algorithms.get("mtp")
    assert f"{unit.article_of({})} {unit.name_of({})} speculative" == "An MTP speculative"
