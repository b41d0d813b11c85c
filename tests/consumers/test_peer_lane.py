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
