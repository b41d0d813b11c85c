"""data_gen captures in the dtype speculators.precision chooses and records it: in every manifest (with the reason
and the CPU it read), in the summary and in run_identity.json, so fp32 and bf16 captures never mix in one
directory."""

from __future__ import annotations

import json

import pytest

from data_gen.pipeline import run_data_gen
from data_gen.store import IncompatibleOutputError, read_manifest
from speculators.precision import ENV_VAR, cpu_facts
from tests.data_gen.conftest import chat_records, write_jsonl
from tests.data_gen.test_pipeline import make_config


def test_capture_records_its_dtype_and_refuses_another_in_the_same_directory(
    tiny_llama_dir, tmp_path, monkeypatch
):
    chats = write_jsonl(tmp_path / "chats.jsonl", chat_records(5, turns=2))
    out = tmp_path / "data"
    monkeypatch.setenv(ENV_VAR, "bfloat16")  # what verifier.dtype=auto gives on a CPU with native bf16
    summary = run_data_gen(
        make_config(tiny_llama_dir, chats, out, verifier__dtype="auto", data__max_length=64)
    )
    for split in ("train", "heldout"):
        verifier = read_manifest(out / split)["verifier"]
        assert verifier["capture_dtype"] == "bfloat16"  # the loaded verifier's own dtype
        record = verifier["precision"]
        assert (record["dtype"], record["source"], record["reason"]) == (
            "bfloat16",
            "env",
            f"{ENV_VAR}=bfloat16",
        )
        assert record["cpu"] == cpu_facts().to_json()
    assert summary["capture_precision"] == record
    assert json.loads((out / "run_identity.json").read_text())["capture_dtype"] == "bfloat16"

    # the recipe's value beats the environment, and an fp32 capture is refused beside the bf16 shards
    with pytest.raises(IncompatibleOutputError, match="capture_dtype: stored 'bfloat16' vs now 'float32'"):
        run_data_gen(make_config(tiny_llama_dir, chats, out, verifier__dtype="float32", data__max_length=64))
