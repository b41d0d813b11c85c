"""The upstream ``speculators==0.9.0`` package (its own virtualenv, no network) loads our export and holds exactly
the weights we wrote: every tensor by name, shape and value digest."""

from __future__ import annotations

import pytest

from speculators.format.checkpoint import load_tensors
from tests.conftest import require_consumer

pytestmark = pytest.mark.consumer


@pytest.fixture(scope="module")
def loaded(random_draft):
    from speculators.serving import load_with_speculators_package
    from speculators.serving.speculators_package import speculators_package_available

    require_consumer(speculators_package_available(), "the speculators virtualenv", "speculators-env")
    _, directory = random_draft
    return load_with_speculators_package(directory)


def test_package_picks_its_eagle3_model_with_our_settings(loaded, random_draft, smollm2_dir):
    model, _ = random_draft
    assert loaded["ok"] and loaded["speculators_version"] == "0.9.0"
    assert loaded["class"].endswith(".Eagle3DraftModel")
    assert loaded["layer_model_type"] == "llama"
    assert loaded["norm_before_residual"] is True
    assert loaded["draft_vocab_size"] == model.config.draft_vocab_size
    assert loaded["vocab_size"] == model.config.vocab_size == 49152
    assert loaded["aux_layer_ids"] == model.config.eagle_aux_hidden_state_layer_ids == [2, 15, 27]
    assert loaded["speculative_tokens"] == [3]
    assert loaded["verifier"] == str(smollm2_dir)


def test_package_loads_every_tensor_we_wrote_unchanged(loaded, random_draft):
    from speculators.serving import tensor_digest

    _, directory = random_draft
    ours = load_tensors(directory)
    theirs = loaded["tensors"]
    assert "embed_tokens.weight" in ours and "d2t" in ours and "t2d" in ours
    for name, tensor in ours.items():
        assert name in theirs, f"the package has no tensor {name}"
        assert theirs[name]["shape"] == list(tensor.shape), name
        assert theirs[name]["sha256"] == tensor_digest(tensor), f"{name} differs after loading"
    # What the package adds on its own comes from the verifier, and nothing is left uninitialised (NaN).
    assert set(theirs) - set(ours) <= {"verifier_lm_head.weight", "verifier_norm.weight"}
    assert not [name for name, info in theirs.items() if info["has_nan"]]
