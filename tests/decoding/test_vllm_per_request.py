"""vLLM's per-request speculative-decoding counters equal our engine's, request by request (greedy, fp32).

``speculators eval --vllm`` asks vLLM 0.32 for ``per_request_spec_decode_metrics="detailed"``: every request comes
back with its own accepted-draft count per verify step, written as ``engine: vllm`` rows of ``requests.jsonl`` next
to ours. For a fitted draft (acceptance neither 0 nor k) the two engines must count the same steps with the same
accepted drafts for every request. The control serves vLLM a copy of the draft whose ``fc`` reads the verifier's aux
layers in the wrong order (a misread weight): its per-request counters must then differ from ours (some requests
only: the fitted draft leans on its token embedding, so the misread changes a few requests, not the totals much)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import require_consumer
from tests.decoding.test_vllm_crosscheck import served_pair  # noqa: F401 - the fitted pair, a module fixture

pytestmark = pytest.mark.consumer

KS = [1, 3]


@pytest.fixture(scope="module")
def per_request_eval(served_pair, tmp_path_factory):  # noqa: F811 - the fixture imported above
    from speculators.eval.evaluation import EvalSettings, evaluate
    from speculators.serving.vllm_bridge import vllm_available

    require_consumer(vllm_available(), "the vLLM virtualenv", "vllm-env")
    verifier_dir, draft_dir = served_pair
    out = tmp_path_factory.mktemp("per-request")
    settings = EvalSettings(
        ks=KS, max_new_tokens=32, max_prompts=8, batch_size=4, vllm=True, compare_plain=False
    )
    results = evaluate(draft_dir, str(verifier_dir), settings=settings, output_dir=out, dtype="float32")
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    return results, rows


@pytest.mark.parametrize("k", KS)
def test_vllm_per_request_counters_equal_ours(per_request_eval, k):
    results, rows = per_request_eval
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
def test_a_misread_weight_makes_vllm_counters_differ(per_request_eval, served_pair, tmp_path):  # noqa: F811
    from speculators.eval.evaluation import EvalSettings, _vllm_runs
    from speculators.eval.recording import RequestLog, RunSpec, compare_requests, vllm_rows
    from speculators.eval.suites import PromptLabel
    from speculators.eval.table import Request

    _, rows = per_request_eval
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
