"""``speculators eval --vllm`` when vLLM refuses: our engine's finished measurements are written all the same, with
vLLM's failure recorded in results.json and said in one line (exit status 1: the cross-check asked for is missing).

The refusal is real: the verifier declares a 64-token context (``max_position_embeddings``), which vLLM will not
exceed for the prompts plus the new tokens eval asks for, while our engine decodes past it."""

from __future__ import annotations

import json

import pytest
import torch

from speculators.cli import main
from speculators.serving import vllm_bridge as bridge
from tests.conftest import require_consumer
from tests.export.conftest import build_draft
from tests.support.verifiers import build_tiny_verifier

pytestmark = [pytest.mark.consumer, pytest.mark.slow]

CONTEXT = 64  # the verifier's max_position_embeddings: shorter than prompt + 48 new tokens


@pytest.fixture(scope="module")
def short_context_draft(tmp_path_factory, smollm2_tokenizer):
    require_consumer(bridge.vllm_available(), "the vLLM virtualenv", "vllm-env")
    root = tmp_path_factory.mktemp("short-context")
    verifier = build_tiny_verifier(
        root / "verifier",
        arch="llama",
        tokenizer=smollm2_tokenizer,
        vocab_size=len(smollm2_tokenizer),
        max_position_embeddings=CONTEXT,
    )
    return build_draft(verifier, draft_vocab_size=256).save_pretrained(root / "draft", dtype=torch.float32)


def test_a_vllm_refusal_keeps_our_engines_results_and_says_why_in_one_line(
    short_context_draft, tmp_path, capsys
):
    out = tmp_path / "eval"
    argv = ["eval", str(short_context_draft), "--max-prompts", "2", "--max-new-tokens", "48", "--k", "2"]
    argv += ["--batch-size", "2", "--threads", "1", "--dtype", "float32", "--vllm", "--output", str(out)]
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 1
    results = json.loads((out / "results.json").read_text())
    assert results["plain"]["generated_tokens"] > 0
    (run,) = results["runs"]
    assert run["name"] == "chain-k2" and run["matches_plain"] == 1.0 and run["generated_tokens"] > 0
    failed = results["vllm"]["failed"]
    assert "max_model_len" in failed and f"max_position_embeddings={CONTEXT}" in failed  # vLLM's own reason
    assert "\n" not in failed and "Traceback" in results["vllm"]["error"]  # the whole story stays in the file
    (line,) = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert failed in line and "Traceback" not in captured.err + captured.out
    assert f"vLLM failed: {failed}" in captured.out  # the summary table says it too
    assert (out / "acceptance.png").is_file()
    # the model card of a re-export with these results says it too, instead of an empty vLLM table
    card = tmp_path / "card"
    assert (
        main(["export", str(short_context_draft), str(card), "--eval-results", str(out / "results.json")])
        == 0
    )
    assert f"vLLM failed on these prompts: {failed}." in (card / "README.md").read_text()
