"""The peer lane (bench/peer_lane.py): our data converted for ``speculators==0.9.0``'s own trainer, 2 steps of it on
the CPU through our device shim, its export checked by our validator.

Tiny data from the real data_gen store (tests/train/conftest.py's verifier and capture): 8 train + 4 held-out
samples of a 6-layer verifier with vocab 512, so the peer's trainer runs in seconds.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.conftest import require_consumer

pytestmark = pytest.mark.consumer

DRAFT_VOCAB = 256


@pytest.fixture(scope="module")
def lane(tmp_path_factory) -> tuple[Path, Path, dict]:
    from speculators.serving.speculators_package import speculators_package_available

    require_consumer(speculators_package_available(), "the speculators virtualenv", "speculators-env")
    from bench.peer_lane import train_peer
    from tests.train.conftest import build_sharp_verifier, write_features

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("peer")
    verifier = build_sharp_verifier(root / "verifier")
    data = write_features(root / "data", verifier, 8, heldout_same=False, seed=0)
    out = root / "out"
    report = train_peer(
        data, out, steps=2, lr=1e-3, draft_vocab_size=DRAFT_VOCAB, tokens_per_step=128, check_init=True
    )
    return data, out, report


def test_converted_files_hold_our_tensors_exactly(lane):
    from bench.peer_lane import read_peer_sample
    from data_gen.store import FeatureDataset

    data, out, report = lane
    row = 0
    for split in ("train", "heldout"):
        ours = FeatureDataset(data / split)
        for index in range(len(ours)):
            sample, theirs = ours[index], read_peer_sample(out / "peer_data", row)
            tokens, hidden = sample["last_hidden"].shape
            hidden_states = theirs["hidden_states"].float()
            assert hidden_states.shape == (tokens, 4, hidden)
            assert torch.equal(hidden_states[:, :3].reshape(tokens, -1), sample["aux_hidden"])
            assert torch.equal(hidden_states[:, 3], sample["last_hidden"])
            assert torch.equal(theirs["token_ids"], sample["input_ids"].long())
            assert torch.equal(theirs["input_ids"], sample["input_ids"].long())
            assert torch.equal(theirs["loss_mask"].bool(), sample["loss_mask"])
            assert int(theirs["seq_len"]) == tokens
            row += 1
    conversion = report["conversion"]
    assert (conversion["train_samples"], conversion["heldout_samples"]) == (8, 4)
    assert (
        int(12 * conversion["train_data_ratio"]) == 8
    )  # the peer's own split lands on our train/held-out one


def test_peer_export_passes_our_validator_with_our_vocab(lane):
    from bench.peer_lane import draft_vocab_for
    from speculators.format.checkpoint import load_checkpoint
    from speculators.format.validate import errors, validate_checkpoint

    data, out, report = lane
    draft = out / "peer_draft"
    assert report["validation"]["passed"], report["validation"]["errors"]
    assert not errors(validate_checkpoint(draft))
    config, tensors = load_checkpoint(draft)
    vocab = draft_vocab_for(data, DRAFT_VOCAB, None)
    assert config["draft_vocab_size"] == DRAFT_VOCAB
    assert torch.equal(tensors["d2t"].long(), vocab.d2t) and torch.equal(tensors["t2d"].bool(), vocab.t2d)
    assert config["eagle_aux_hidden_state_layer_ids"] == report["conversion"]["aux_layer_ids"]
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1


def test_peer_trained(lane):
    _, _, report = lane
    assert report["steps"] == 2 and report["cpu_shim_applied"] is True
    changes = report["weight_max_abs_change"]
    assert changes["fc.weight"] > 0 and changes["layers.0.self_attn.q_proj.weight"] > 0
    assert changes["layers.0.mlp.down_proj.weight"] > 0
    assert changes["embed_tokens.weight"] == 0  # the peer freezes the verifier's embedding, as ours does
    # ...and its lm_head (the verifier's rows): ours trains it. If this fails, peer_lane's not_matched is stale.
    assert changes["lm_head.weight"] == 0
    losses = report["losses"]
    assert losses["last_train_step"] == 1
    assert math.isfinite(losses["last_train"]["loss"])
    assert report["cpu_seconds"] > 0 and report["tokens_trained"] > 0


# ---- the parallel drafters (issue 20): the peer's own P-EAGLE and DFlash on the same converted data ------------
@pytest.fixture(scope="module")
def parallel_lanes(lane) -> dict[str, dict]:
    """P-EAGLE under a tiny CPU budget (a probe, then the steps that fit; the cap is far above them) and DFlash
    for 2 steps, on the lane's data."""
    from bench.peer_lane import train_peer

    data, out, _ = lane
    root = out.parent
    common = dict(lr=1e-3, draft_vocab_size=DRAFT_VOCAB, tokens_per_step=128)
    peagle = train_peer(
        data, root / "peagle", steps=10_000, algorithm="peagle", cpu_budget=0.3, probe_steps=3, **common
    )
    dflash = train_peer(data, root / "dflash", steps=2, algorithm="dflash", draft={"block_size": 4}, **common)
    return {"peagle": peagle, "dflash": dflash}


def test_peer_peagle_trains_to_the_cpu_budget_and_exports_what_our_validator_accepts(parallel_lanes):
    from speculators.format.checkpoint import load_checkpoint

    report = parallel_lanes["peagle"]
    budget = report["budget"]
    # the steps are what the probe's CPU per step fits in the budget, and the run took exactly those
    assert budget["probe_cpu_seconds_per_step"] > 0 and budget["steps_cap"] == 10_000
    assert budget["steps"] == max(1, int(0.3 / budget["probe_cpu_seconds_per_step"])) < 10_000
    assert report["steps"] == budget["steps"] and report["losses"]["last_train_step"] == budget["steps"] - 1
    assert report["validation"]["passed"], report["validation"]["errors"]
    config, tensors = load_checkpoint(Path(report["export"]["dir"]))
    assert config["speculators_model_type"] == "peagle"
    assert (
        config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
        == report["draft"]["ttt_steps"]
    )
    # the mask token is the one our resolver picks for this data (no tokenizer: the lowest unused id)
    assert config["mask_token_id"] == report["draft"]["mask_token_id"]
    assert "never occurs" in report["draft"]["mask_token_reason"]
    assert "mask_hidden" in tensors and "embed_tokens.weight" in tensors


def test_peer_dflash_trains_validates_and_our_engine_loads_it_without_an_embedding(parallel_lanes):
    from speculators.format.checkpoint import read_config

    report = parallel_lanes["dflash"]
    config = read_config(Path(report["export"]["dir"]))
    assert config["speculators_model_type"] == "dflash" and config["block_size"] == 4
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["aux_hidden_state_layer_ids"] == report["conversion"]["aux_layer_ids"]
    assert config["mask_token_id"] == report["draft"]["mask_token_id"]
    # causal blocks as ours: every layer sliding (window = the verifier's context), intra-block causal
    layers = config["transformer_layer_config"]
    assert (
        set(layers["layer_types"]) == {"sliding_attention"} and config["sliding_window_non_causal"] is False
    )
    assert report["losses"]["last_train_step"] == 1 and math.isfinite(report["losses"]["last_train"]["loss"])
    # speculators 0.9.0 saves no embed_tokens for DFlash (the unit declares embed_from_verifier): it validates, and
    # our loader takes the verifier's embedding, as the library and vLLM do
    from safetensors import safe_open

    from speculators import algorithms
    from speculators.verifier import verifier_embedding

    with safe_open(str(Path(report["export"]["dir"]) / "model.safetensors"), framework="pt") as handle:
        assert "embed_tokens.weight" not in set(handle.keys())
    assert report["validation"]["errors"] == []
    draft = algorithms.load_draft(Path(report["export"]["dir"]))
    name = config["speculators_config"]["verifier"]["name_or_path"]
    assert torch.equal(draft.embed_tokens.weight, verifier_embedding(name).float())
    assert any(gap.startswith("anchors:") for gap in report["not_matched"])  # DFlash's own gaps, recorded


def test_recipe_settings_become_the_peer_flags(lane):
    """Our recipes' draft settings (composed by Hydra) are what the peer is told: P-EAGLE's K and COD cap, DFlash's
    block size, layers, anchors and slot weighting."""
    from hydra import compose, initialize_config_dir

    from bench.peer_lane import ALGORITHMS, REPO, recipe_settings

    data, _, _ = lane
    for name in ("peagle", "dflash"):
        recipe = ALGORITHMS[name].recipe
        with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[f"recipe={recipe}"])
        draft = recipe_settings(recipe, [], data, name)["draft"]
        flags = ALGORITHMS[name].draft_flags({**draft, "mask_token_id": 7, "sliding_window": 8192})
        pairs = dict(zip(flags, flags[1:], strict=False))
        assert pairs["--mask-token-id"] == "7" and draft["num_layers"] == cfg.model.num_layers
        if name == "peagle":
            assert pairs["--num-depths"] == str(cfg.train.ttt_steps)
            assert pairs["--max-anchors"] == str(cfg.peagle.max_anchors)
        else:
            assert pairs["--block-size"] == str(cfg.block.block_size)
            assert pairs["--max-anchors"] == str(cfg.block.max_anchors)
            assert pairs["--dflash-decay-gamma"] == repr(float(cfg.block.decay_gamma))
            assert ("--no-sliding-window-non-causal" in flags) == bool(cfg.block.block_causal)
    with pytest.raises(SystemExit, match="pass --algorithm dflash"):
        recipe_settings("dflash_smollm2_large", [], data, "peagle")
