"""Proof that exports and conversions serve as they are: vLLM on CPU (auto mode from the draft directory, and the
verifier with an explicit speculative_config) reads them and reports the acceptance the weights imply.

Deterministic acceptance (docs/format.md): the verifier's final norm is zeroed, so its logits are all zero and greedy
decoding always emits token 0; each draft's norm is zeroed, so it always proposes its draft id 0. When d2t sends
draft id 0 to token 0 every proposal is accepted (mean acceptance length k + 1); when the vocabulary leaves token
0 out, none is (1.0). Anything misread (names, d2t offsets, the config) breaks one of these numbers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculators.cli import main as cli_main
from speculators.export import convert_checkpoint, export_checkpoint
from speculators.format import load_checkpoint
from speculators.serving import speculators_package as package
from speculators.serving import vllm_bridge as bridge
from tests.conftest import require_consumer
from tests.export.conftest import (
    SERVABLE_SHAPE,
    build_draft,
    make_run,
    write_eagle3_original,
    write_specforge,
)
from tests.support.verifiers import build_tiny_verifier

pytestmark = [
    pytest.mark.consumer,
    pytest.mark.filterwarnings("ignore::speculators.export.ExportWarning"),
]
PROMPTS = [[{"role": "user", "content": "What is the capital of France?"}], "Once upon a time"]


def zero_norm(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        model.norm.weight.zero_()
    return model


@pytest.fixture(scope="module")
def always_zero_verifier(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A random 8-layer Llama (SmolLM2 tokenizer) whose final norm is zero: greedy decoding always gives token 0."""
    directory = build_tiny_verifier(
        tmp_path_factory.mktemp("consumers") / "zero-verifier",
        tokenizer=smollm2_tokenizer,
        vocab_size=len(smollm2_tokenizer),
        **SERVABLE_SHAPE,
    )
    weights = load_file(str(directory / "model.safetensors"))
    weights["model.norm.weight"] = torch.zeros_like(weights["model.norm.weight"])
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, always_zero_verifier) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("served")
    verifier = str(always_zero_verifier)
    accept = zero_norm(build_draft(always_zero_verifier, keep_token=0, seed=1))
    reject = zero_norm(build_draft(always_zero_verifier, drop_token=0, seed=2))
    assert int(accept.d2t[0]) == 0 and int(reject.d2t[0]) > 0
    exported = {
        "accept": export_checkpoint(
            make_run(root / "run-a", verifier, {10: accept}, 10, speculative_tokens=3), root / "accept"
        ),
        "reject": export_checkpoint(
            make_run(root / "run-r", verifier, {10: reject}, 10, speculative_tokens=3), root / "reject"
        ),
    }
    legacy = zero_norm(build_draft(always_zero_verifier, keep_token=0, seed=3, norm_before_residual=False))
    original = write_eagle3_original(root / "eagle3-original", legacy)
    specforge = write_specforge(root / "specforge", legacy, aux_ids=[1, 3, 4])
    found = {
        **{name: result.out_dir for name, result in exported.items()},
        "original": convert_checkpoint(original, root / "original-converted", verifier=verifier).out_dir,
        "specforge": convert_checkpoint(specforge, root / "specforge-converted", verifier=verifier).out_dir,
    }
    for directory in found.values():
        assert cli_main(["validate", str(directory)]) == 0  # `speculators validate` before serving
    return found


@pytest.fixture(scope="module")
def served(checkpoints, always_zero_verifier):
    """Every configuration in ONE vLLM worker process (one import; engines one after another)."""
    require_consumer(bridge.vllm_available(), "the vLLM virtualenv", "vllm-env")
    requests = {
        "auto": bridge.VllmRequest(model=checkpoints["accept"], prompts=PROMPTS),
        "explicit": bridge.VllmRequest(
            model=always_zero_verifier,
            prompts=PROMPTS,
            speculative_config=bridge.eagle3_speculative_config(checkpoints["accept"], 3),
        ),
        "reject": bridge.VllmRequest(model=checkpoints["reject"], prompts=PROMPTS),
        "original": bridge.VllmRequest(model=checkpoints["original"], prompts=PROMPTS),
        "specforge": bridge.VllmRequest(
            model=always_zero_verifier,
            prompts=PROMPTS,
            speculative_config=bridge.eagle3_speculative_config(checkpoints["specforge"], 2),
        ),
    }
    for name, request in requests.items():
        request.name, request.max_tokens, request.ignore_eos, request.max_model_len = name, 24, True, 512
        # vLLM's serving dtype, as before "auto" existed (zero logits are exact in any dtype)
        request.dtype = "bfloat16"
    results = bridge.run_vllm(list(requests.values()), timeout=600)
    return {result.name: result for result in results}


@pytest.mark.parametrize("mode", ["auto", "explicit"])
def test_vllm_serves_the_export_with_full_acceptance(served, mode):
    result = served[mode]
    assert all(ids == [0] * 24 for ids in result.token_ids)  # the verifier's greedy output, unchanged
    spec = result.spec
    assert spec is not None and spec.num_speculative_tokens == 3 and spec.num_drafts > 0
    assert spec.acceptance_rate == 1.0, spec
    assert spec.mean_acceptance_length == 4.0


def test_vllm_reads_d2t_offsets_a_draft_without_token_0_is_never_accepted(served):
    spec = served["reject"].spec
    assert spec.num_drafts > 0 and spec.num_accepted_tokens == 0
    assert spec.mean_acceptance_length == 1.0


@pytest.mark.parametrize("layout,k", [("original", 3), ("specforge", 2)])
def test_vllm_serves_converted_checkpoints(served, layout, k):
    spec = served[layout].spec
    assert spec.num_speculative_tokens == k and spec.num_drafts > 0
    assert spec.acceptance_rate == 1.0 and spec.mean_acceptance_length == k + 1


@pytest.mark.parametrize("name", ["accept", "original"])
def test_speculators_package_loads_it_offline_tensor_for_tensor(checkpoints, name):
    """speculators==0.9.0 (its own virtualenv) loads the directory offline and holds exactly our weights."""
    require_consumer(package.speculators_package_available(), "the speculators virtualenv", "speculators-env")
    loaded = package.load_with_speculators_package(checkpoints[name])
    config, tensors = load_checkpoint(checkpoints[name])
    assert loaded["ok"] and loaded["speculators_version"] == "0.9.0"
    assert loaded["layer_model_type"] == "llama" and loaded["aux_layer_ids"] == [2, 4, 5]
    assert loaded["norm_before_residual"] is config["norm_before_residual"]
    assert loaded["speculative_tokens"] == [
        config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    ]
    assert loaded["verifier"] == config["speculators_config"]["verifier"]["name_or_path"]
    missing = sorted(set(tensors) - set(loaded["tensors"]))
    assert missing == [], missing
    for tensor_name, tensor in tensors.items():
        assert loaded["tensors"][tensor_name]["sha256"] == package.tensor_digest(tensor), tensor_name
