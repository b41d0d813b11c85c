"""Our acceptance length agrees with vLLM's for the same exported draft, verifier, prompts and k (greedy, fp32).

The verifier is a small random Llama that vLLM's CPU attention accepts (head_dim 64) and the draft is fitted to it
briefly, so acceptance is neither 0 nor 100% and differs between prompts. Both engines get the same token prompts
via ``speculators eval --vllm`` (the ``evaluate`` API), which also exercises that option end to end. The same holds
for a DFlash (block) draft fitted to the same verifier, causal and bidirectional, with k below its block too.

Request by request too: ``speculators eval --vllm`` asks vLLM 0.32 for ``per_request_spec_decode_metrics="detailed"``,
so every request comes back with its own accepted-draft count per verify step, written as ``engine: vllm`` rows of
``requests.jsonl`` next to ours, and the two engines must count the same steps with the same accepted drafts for
every request. The control serves vLLM a copy of the draft whose ``fc`` reads the verifier's aux layers in the wrong
order (a misread weight): its per-request counters must then differ from ours (some requests only: the fitted draft
leans on its token embedding, so the misread changes a few requests, not the totals much)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import require_consumer
from tests.support.tiny_models import single_thread

pytestmark = pytest.mark.consumer

KS = [1, 3]
TOLERANCE = 0.02  # relative difference of the acceptance lengths (measured here: identical to 4 decimals)


@pytest.fixture(scope="module")
def served_pair(tmp_path_factory, smollm2_tokenizer, chat_prompts):
    from speculators.verifier import load_verifier
    from tests.support.quickfit import fit_draft
    from tests.support.verifiers import build_tiny_verifier

    root = tmp_path_factory.mktemp("vllm-crosscheck")
    verifier_dir = build_tiny_verifier(
        root / "verifier",
        arch="llama",
        seed=3,
        tokenizer=smollm2_tokenizer,
        vocab_size=len(smollm2_tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    verifier = load_verifier(str(verifier_dir), dtype="float32")[0]
    with single_thread():
        draft, _ = fit_draft(
            verifier,
            chat_prompts[:8],
            name_or_path=str(verifier_dir),
            draft_vocab_size=512,
            max_new_tokens=32,
            steps=60,
            lr=5e-3,
        )
    draft_dir = draft.save_pretrained(root / "draft", dtype=torch.float32)
    return verifier_dir, draft_dir


@pytest.fixture(scope="module")
def evaluated(served_pair, tmp_path_factory):
    """ONE ``speculators eval --vllm`` of the pair at every k (vLLM without the draft too): its results and its
    request table."""
    from speculators.eval.evaluation import EvalSettings, evaluate
    from speculators.serving.vllm_bridge import vllm_available

    require_consumer(vllm_available(), "the vLLM virtualenv", "vllm-env")
    verifier_dir, draft_dir = served_pair
    out = tmp_path_factory.mktemp("evaluated")
    settings = EvalSettings(ks=KS, max_new_tokens=32, max_prompts=8, batch_size=4, vllm=True)
    results = evaluate(draft_dir, str(verifier_dir), settings=settings, output_dir=out, dtype="float32")
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    return results, rows


def test_acceptance_length_matches_vllm(evaluated):
    results, _ = evaluated
    assert_agrees_with_vllm(results)
    # vLLM without the draft ran on the same prompts: the baseline of the tokens/s comparison.
    assert (
        results["vllm"]["plain"]["tokens_per_s"] > 0 and results["vllm"]["plain"]["acceptance_length"] is None
    )


def assert_agrees_with_vllm(results: dict) -> None:
    """Every run's acceptance (overall and per position) and outputs equal vLLM's for the same k."""
    for run in results["runs"]:
        theirs = results["vllm"][run["name"]]
        ours = run["acceptance_length_global"]
        print(
            f"{run['name']}: ours {ours:.4f}, vLLM {theirs['acceptance_length']:.4f}, "
            f"identical outputs {theirs['outputs_identical_to_ours']:.0%}"
        )
        assert theirs["outputs_identical_to_ours"] >= 0.9  # fp32 greedy: the same tokens, barring rare ties
        assert 1.2 < ours < run["k"] + 1, ours  # mixed acceptance: the comparison is not trivially 1 or k+1
        assert abs(ours - theirs["acceptance_length"]) <= TOLERANCE * ours, (run["name"], ours, theirs)
        per_position = zip(
            run["per_position_acceptance_unconditional"],
            theirs["per_position_acceptance_unconditional"],
            strict=True,
        )
        assert all(abs(a - b) <= TOLERANCE for a, b in per_position), (run, theirs)
        assert theirs["speedup_vs_vllm_plain"] > 0


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_dflash_acceptance_matches_vllm(served_pair, chat_prompts, tmp_path, causal):
    """A DFlash draft (4 draft slots) fitted to the same verifier: our block drafting equals vLLM's, with the whole
    block (k = 4) and with fewer slots than it has (k = 2: vLLM then runs a block of 1 + k slots)."""
    from speculators.eval.evaluation import EvalSettings, evaluate
    from speculators.serving.vllm_bridge import vllm_available
    from speculators.verifier import load_verifier
    from tests.support.quickfit_block import fit_block_draft

    require_consumer(vllm_available(), "the vLLM virtualenv", "vllm-env")
    verifier_dir, _ = served_pair
    verifier = load_verifier(str(verifier_dir), dtype="float32")[0]
    with single_thread():
        draft, _ = fit_block_draft(
            verifier, chat_prompts[:8], str(verifier_dir), block_size=5, block_causal=causal, steps=300
        )
    draft_dir = draft.save_pretrained(tmp_path / "dflash", dtype=torch.float32)
    settings = EvalSettings(ks=[4, 2], max_new_tokens=32, max_prompts=12, batch_size=4, vllm=True)
    results = evaluate(draft_dir, str(verifier_dir), settings=settings, dtype="float32")
    assert_agrees_with_vllm(results)


@pytest.mark.parametrize("k", KS)
def test_vllm_per_request_counters_equal_ours(evaluated, k):
    results, rows = evaluated
    run = f"chain-k{k}"
    ours = {r["request"]: r for r in rows if r["engine"] == "ours" and r["run"] == run}
    theirs = {r["request"]: r for r in rows if r["engine"] == "vllm" and r["run"] == run}
    assert set(ours) == set(theirs) and len(ours) == 8
    for request, row in theirs.items():
        assert row["accepted_per_step"] == ours[request]["accepted_per_step"], request
        assert row["drafted_per_step"] == [k] * len(row["accepted_per_step"]), request
    accepted = [c for r in ours.values() for c in r["accepted_per_step"]]
    assert 0 < sum(accepted) < k * len(accepted)  # mixed acceptance: equality is not trivially all-or-nothing
    assert len({tuple(r["accepted_per_step"]) for r in ours.values()}) > 1  # requests differ from each other
    assert results["vllm"][run]["per_request_counters_equal"] == 1.0
    assert results["reports"]["runs"][f"vllm/{run}"]["overall"]["acceptance_length_global"] == pytest.approx(
        results["vllm"][run]["acceptance_length"]
    )


def misread_copy(draft_dir, verifier_dir, target):
    """The draft with ``fc``'s input blocks rotated by one aux layer: vLLM then reads layer i's states as i+1's."""
    target.mkdir()
    for path in draft_dir.iterdir():
        if path.name != "model.safetensors":
            target.joinpath(path.name).write_bytes(path.read_bytes())
    weights = load_file(str(draft_dir / "model.safetensors"))
    fc = weights["fc.weight"]
    hidden = json.loads((verifier_dir / "config.json").read_text())["hidden_size"]  # one aux layer's width
    assert fc.shape[1] % hidden == 0 and fc.shape[1] > hidden
    weights["fc.weight"] = torch.roll(fc, shifts=hidden, dims=1).contiguous()
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


@pytest.mark.slow  # a second vLLM engine
def test_a_misread_weight_makes_vllm_counters_differ(evaluated, served_pair, tmp_path):
    from speculators.eval.evaluation import EvalSettings, _vllm_runs
    from speculators.eval.recording import RequestLog, RunSpec, compare_requests, vllm_rows
    from speculators.eval.suites import PromptLabel
    from speculators.eval.table import Request

    _, rows = evaluated
    verifier_dir, draft_dir = served_pair
    ours = [Request.from_json(r) for r in rows if r["engine"] == "ours" and r["run"] == "chain-k3"]
    prompts = _prompts_of(served_pair, len(ours))
    settings = EvalSettings(ks=[3], max_new_tokens=32, compare_plain=False)
    vllm = _vllm_runs(
        misread_copy(draft_dir, verifier_dir, tmp_path / "misread"), str(verifier_dir), prompts, settings
    )
    labels = [PromptLabel("chats", "chats", str(i)) for i in range(len(prompts))]
    theirs = vllm_rows(
        vllm["chain-k3"], RunSpec("vllm", "chain-k3", "chain", 3, 3), prompts, labels, RequestLog()
    )
    compared = compare_requests(ours, theirs)
    # measured: 2 of 8 requests change; the run-level acceptance length barely moves, the per-request check sees it
    assert compared["per_request_counters_equal"] < 1.0, compared
    differing = {
        r.request: r.accepted_per_step for r in theirs if r.request in compared["requests_differing"]
    }
    assert all(
        steps != next(o for o in ours if o.request == i).accepted_per_step for i, steps in differing.items()
    )


def _prompts_of(pair, count):
    """The token prompts the evaluation used: the shipped chats rendered with the verifier's tokenizer."""
    from transformers import AutoTokenizer

    from speculators.eval.prompts import load_prompts, select_prompts

    tokenizer = AutoTokenizer.from_pretrained(pair[0])
    return select_prompts(tokenizer, load_prompts(None), None, count)[0]


def test_vllm_one_request_at_a_time_beside_the_batch(served_pair):
    """``--batch-size 1`` (the demo's): vLLM is also timed with the prompts submitted one after the other on the
    same engine, generating the same greedy tokens as the batch, and the speed-up one request at a time is against
    vLLM's own plain decoding one request at a time."""
    from speculators.eval.evaluation import EvalSettings, _vllm_runs

    verifier_dir, draft_dir = served_pair
    prompts = _prompts_of(served_pair, 3)
    settings = EvalSettings(ks=[2], max_new_tokens=16, batch_size=1)
    vllm = _vllm_runs(draft_dir, str(verifier_dir), prompts, settings)
    for name in ("plain", "chain-k2"):
        assert vllm[name]["generated_tokens_one_at_a_time"] == vllm[name]["generated_tokens"]
        assert vllm[name]["tokens_per_s_one_at_a_time"] > 0
        assert vllm[name]["interleaved"] is False  # one engine after the other (the A/A-checked method)
    chain, plain = vllm["chain-k2"], vllm["plain"]
    assert chain["speedup_vs_vllm_plain_one_at_a_time"] == pytest.approx(
        chain["tokens_per_s_one_at_a_time"] / plain["tokens_per_s_one_at_a_time"]
    )
    assert chain["speedup_vs_vllm_plain"] == pytest.approx(chain["tokens_per_s"] / plain["tokens_per_s"])


def test_the_interleaved_schedule_runs_each_prompt_on_every_engine_in_alternating_order():
    from speculators.eval.evaluation import interleaved_schedule

    schedule = interleaved_schedule(2, 4)
    assert schedule == [(0, 0), (0, 1), (1, 1), (1, 0), (2, 0), (2, 1), (3, 1), (3, 0)]
    three = interleaved_schedule(3, 5)
    assert sorted(three) == [(p, r) for p in range(5) for r in range(3)]  # every pair exactly once
    firsts = [three[i * 3][1] for i in range(5)]
    assert firsts == [0, 2, 0, 2, 0]  # no engine always first


def test_interleaved_timing_keeps_an_engine_per_request_and_times_every_prompt_on_each(served_pair):
    """The bench's interleaved method (bench/vllm_timing_bench.py): both engines loaded, each prompt timed on each,
    the same greedy tokens as the batch."""
    from dataclasses import replace

    from speculators.eval.evaluation import EvalSettings, time_vllm_requests, vllm_requests

    verifier_dir, draft_dir = served_pair
    prompts = _prompts_of(served_pair, 2)
    plain, chain = vllm_requests(
        draft_dir, str(verifier_dir), prompts, EvalSettings(ks=[2], max_new_tokens=8)
    )
    results, alone = time_vllm_requests([plain, replace(chain, name="draft")], True, interleave=True)
    assert [r.name for r in results] == ["plain", "draft"]
    for result in results:
        assert alone[result.name]["interleaved"] is True
        assert alone[result.name]["generated_tokens_one_at_a_time"] == result.num_generated_tokens
