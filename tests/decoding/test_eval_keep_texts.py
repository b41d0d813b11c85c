"""``speculators eval --keep-texts`` (issue 41): the request table carries each request's prompt chat and decoded
output only when asked, and such a table is a served-traffic log that data_gen reads back as conversations."""

from __future__ import annotations

import copy
import json
import time

import pytest
import torch

from data_gen.sources import DataSettings, SourceError, load_conversations
from speculators.cli import main
from speculators.eval.table import read_requests

TEXT_KEYS = {"messages", "output_text", "model", "created", "temperature", "finish_reason"}


@pytest.fixture(scope="module")
def exported_draft(tmp_path_factory, fitted_llama_draft, tiny_llama_dir):
    """The fitted draft saved in the standard format, naming the tiny Llama as its verifier."""
    draft = copy.deepcopy(fitted_llama_draft)
    draft.config.speculators_config.verifier.name_or_path = str(tiny_llama_dir)
    return draft.save_pretrained(tmp_path_factory.mktemp("drafts") / "fitted", dtype=torch.float32)


def run_eval(draft, out, *extra: str) -> list[dict]:
    """A cheap evaluation (3 prompts, plain and k = 1, 8 new tokens); its requests.jsonl rows as plain JSON."""
    argv = [
        "eval",
        str(draft),
        "--k",
        "1",
        "--max-prompts",
        "3",
        "--max-new-tokens",
        "8",
        "--batch-size",
        "3",
    ]
    argv += ["--no-oracle", "--dtype", "float32", "--output", str(out), *extra]
    assert main(argv) == 0
    return [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def kept(exported_draft, tmp_path_factory):
    """An evaluation with --keep-texts: its output dir, rows, and when it started."""
    out = tmp_path_factory.mktemp("eval") / "kept"
    started = time.time()
    return out, run_eval(exported_draft, out, "--keep-texts"), started


@pytest.fixture(scope="module")
def plain(exported_draft, tmp_path_factory):
    """The same evaluation without --keep-texts: its output dir and rows."""
    out = tmp_path_factory.mktemp("eval") / "plain"
    return out, run_eval(exported_draft, out)


def test_rows_carry_their_texts_only_with_keep_texts(kept, plain, tiny_llama_dir):
    out, rows, started = kept
    assert len(rows) == 6 and {row["run"] for row in rows} == {"plain", "chain-k1"}
    for row in rows:
        assert TEXT_KEYS <= set(row)
        assert row["messages"][-1]["role"] == "user" and row["output_text"].strip()
        assert row["model"] == str(tiny_llama_dir) and started <= row["created"] <= time.time()
        assert row["finish_reason"] in ("stop", "length") and row["temperature"] == 0.0
    assert (rows[0]["finish_reason"] == "length") == (rows[0]["output_tokens"] == 8)
    assert [r.request for r in read_requests(out / "requests.jsonl")] == [row["request"] for row in rows]
    plain_rows = plain[1]
    assert len(plain_rows) == 6 and not TEXT_KEYS & set().union(*plain_rows)


def test_kept_rows_read_back_as_served_conversations(kept, tiny_llama_dir):
    out, rows, _ = kept
    settings = DataSettings.from_mapping({"source": str(out / "requests.jsonl")})
    conversations, report = load_conversations(settings, verifier=str(tiny_llama_dir))
    served = {(json.dumps(row["messages"]), row["output_text"]) for row in rows}
    assert len(conversations) == len(served) and report.formats == {"served": len(served)}
    assert report.dropped == {
        "duplicate": len(rows) - len(served)
    }  # greedy fp32: k = 1 repeats plain's texts
    assert {(json.dumps(c.messages[:-1]), c.messages[-1]["content"]) for c in conversations} == served
    assert all(c.created is not None for c in conversations) and report.temperatures == {"0": len(served)}


def test_rows_without_texts_are_refused_by_data_gen(plain, tiny_llama_dir):
    settings = DataSettings.from_mapping({"source": str(plain[0] / "requests.jsonl")})
    with pytest.raises(SourceError, match=r"requests.jsonl line 1: .* rerun eval with --keep-texts"):
        load_conversations(settings, verifier=str(tiny_llama_dir))
