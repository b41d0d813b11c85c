"""The speculators 0.9.0 package's own DFlash converter and ours agree: a z-lab-layout draft converted by the
package (its virtualenv), then by ``speculators convert``, is exactly our direct conversion of the z-lab draft.
This pins the package's real output layout (no embed_tokens, no full-vocabulary lm_head, its causality flag) and
the z-lab aux-id convention (target_layer_ids + 1) against the package itself."""

from __future__ import annotations

import warnings

import pytest
import torch

from speculators.export import ExportWarning, convert_checkpoint
from speculators.format import load_checkpoint
from speculators.format.checkpoint import load_tensors, read_config
from tests.conftest import require_consumer
from tests.support.dflash import build_dflash_draft, zlab_source

pytestmark = pytest.mark.consumer


def test_package_conversion_of_a_zlab_draft_converts_to_ours(smollm2_dir, tmp_path):
    from speculators.serving import convert_dflash_with_speculators_package, speculators_package_available

    require_consumer(speculators_package_available(), "the speculators virtualenv", "speculators-env")
    model = build_dflash_draft(smollm2_dir, block_causal=False, seed=5)
    source = zlab_source(model, tmp_path / "zlab", num_target_layers=30)

    loaded = convert_dflash_with_speculators_package(source, tmp_path / "package", smollm2_dir)
    assert loaded["ok"] and loaded["speculators_version"] == "0.9.0"
    assert loaded["class"].endswith("dflash.core.DFlashDraftModel")
    assert loaded["aux_layer_ids"] == [2, 15, 27]  # z-lab's target_layer_ids [1, 14, 26] + 1
    assert loaded["block_keys"]["block_size"] == 4 and loaded["block_keys"]["mask_token_id"] == 49151
    written = read_config(tmp_path / "package")
    assert (
        written["sliding_window_non_causal"] is False
    )  # on full-attention layers: vLLM would run them causally
    stored = load_tensors(tmp_path / "package")
    assert "embed_tokens.weight" not in stored and "lm_head.weight" not in stored

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExportWarning)
        convert_checkpoint(tmp_path / "package", tmp_path / "via-package", dtype="float32")
        convert_checkpoint(source, tmp_path / "direct", verifier=str(smollm2_dir), dtype="float32")
    via, via_tensors = load_checkpoint(tmp_path / "via-package")
    direct, direct_tensors = load_checkpoint(tmp_path / "direct")
    for key in ("aux_hidden_state_layer_ids", "mask_token_id", "block_size", "sliding_window_non_causal"):
        assert via[key] == direct[key], key
    assert via["sliding_window_non_causal"] is True
    assert via["speculators_config"]["proposal_methods"] == direct["speculators_config"]["proposal_methods"]
    assert set(via_tensors) == set(direct_tensors) == set(model.export_state_dict())
    for name, tensor in direct_tensors.items():
        assert torch.equal(via_tensors[name], tensor), name
