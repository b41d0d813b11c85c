"""What the consumers assume and ``speculators validate`` must check: weights in a dtype they load, a verifier
the cross-checks could actually read (or one line saying why they did not run), and weight files that are whole
safetensors files (or one error naming the file and the fix, never a library traceback)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculators.cli import main as cli_main
from speculators.format.checkpoint import read_config
from speculators.format.validate import errors, validate_checkpoint
from tests.support.verifiers import build_tiny_verifier

from .test_roundtrip import build_draft
from .test_validate import mutate

REEXPORT = "re-export with `speculators export --dtype bfloat16`"
UNREADABLE = "truncated or not a safetensors file; re-export or re-download it"


@pytest.fixture(scope="module")
def verifier(tmp_path_factory) -> Path:
    return build_tiny_verifier(tmp_path_factory.mktemp("verifier") / "v_llama", vocab_size=1000)


@pytest.fixture(scope="module")
def bf16_draft(tmp_path_factory, verifier) -> Path:
    """A valid draft as published: bf16 weights, int64 d2t and bool t2d, config torch_dtype bfloat16."""
    model = build_draft(verifier, draft_vocab_size=256)
    return model.save_pretrained(tmp_path_factory.mktemp("good") / "draft", dtype=torch.bfloat16)


def validate_cli(directory: Path, capsys, *extra: str) -> tuple[int, list[str]]:
    status = cli_main(["validate", str(directory), *extra])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return status, captured.out.splitlines()


def weights_as(dtype: torch.dtype) -> Callable[[dict], None]:
    def cast(tensors: dict) -> None:
        for name in tensors:
            if name not in ("d2t", "t2d"):
                tensors[name] = tensors[name].to(dtype)

    return cast


def naming(verifier_path: str) -> Callable[[dict], None]:
    def apply(config: dict) -> None:
        config["speculators_config"]["verifier"]["name_or_path"] = verifier_path

    return apply


# ---- weight dtypes -----------------------------------------------------------------------------------------
def test_a_published_bf16_draft_with_int64_and_bool_index_tensors_has_no_finding(
    bf16_draft, verifier, capsys
):
    tensors = load_file(bf16_draft / "model.safetensors")
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert validate_checkpoint(bf16_draft, read_config(verifier)) == []
    assert validate_cli(bf16_draft, capsys)[0] == 0


def test_integer_weights_are_an_error_naming_the_tensor_and_the_fix(bf16_draft, tmp_path, capsys):
    """All-zero int8 weights pass every shape and NaN check; a consumer would read them as numbers."""

    def quantized_fc(tensors: dict) -> None:
        tensors["fc.weight"] = torch.zeros_like(tensors["fc.weight"], dtype=torch.int8)

    bad = mutate(bf16_draft, tmp_path / "int8", tensors_fn=quantized_fc)
    status, lines = validate_cli(bad, capsys)
    assert status == 1
    found = [line for line in lines if line.startswith("ERROR") and "fc.weight" in line]
    assert len(found) == 1, lines
    assert "dtype int8" in found[0] and REEXPORT in found[0]
    assert "1 error(s)" in lines[-1]


def test_float64_weights_under_a_bfloat16_config_are_one_error(bf16_draft, tmp_path, capsys):
    bad = mutate(bf16_draft, tmp_path / "float64", tensors_fn=weights_as(torch.float64))
    assert read_config(bad)["torch_dtype"] == "bfloat16"
    status, lines = validate_cli(bad, capsys)
    assert status == 1
    found = [line for line in lines if line.startswith("ERROR")]
    assert len(found) == 1, lines  # one line for the whole checkpoint, not one per tensor
    assert "dtype float64" in found[0] and "fc.weight" in found[0] and REEXPORT in found[0]


def test_float_weights_of_another_dtype_than_torch_dtype_are_a_warning(bf16_draft, tmp_path, capsys):
    """Consumers cast a float32 draft, so it loads; but its config says bfloat16, which is a surprise."""
    mixed = mutate(bf16_draft, tmp_path / "float32", tensors_fn=weights_as(torch.float32))
    status, lines = validate_cli(mixed, capsys)
    assert status == 0
    found = [line for line in lines if line.startswith("WARNING") and "torch_dtype" in line]
    assert len(found) == 1, lines
    assert (
        "stored as float32 but config.json torch_dtype says bfloat16" in found[0] and "fc.weight" in found[0]
    )


def test_float16_weights_under_a_float16_config_are_clean(bf16_draft, tmp_path, verifier):
    def say_float16(config: dict) -> None:
        config["torch_dtype"] = "float16"

    half = mutate(bf16_draft, tmp_path / "float16", say_float16, weights_as(torch.float16))
    assert validate_checkpoint(half, read_config(verifier)) == []


# ---- a verifier the cross-checks cannot read ---------------------------------------------------------------
def test_a_missing_absolute_verifier_path_says_the_checks_did_not_run(bf16_draft, tmp_path, capsys):
    gone = tmp_path / "deleted" / "v_llama"
    draft = mutate(bf16_draft, tmp_path / "draft", config_fn=naming(str(gone)))
    status, lines = validate_cli(draft, capsys)
    assert status == 0
    assert any(
        line.startswith("WARNING")
        and f"verifier checks not run: {gone} does not exist; pass --verifier DIR" in line
        for line in lines
    ), lines


def test_a_missing_relative_verifier_path_says_the_checks_did_not_run(
    bf16_draft, tmp_path, monkeypatch, capsys
):
    draft = mutate(bf16_draft, tmp_path / "drafts" / "d", config_fn=naming("../v_llama"))
    monkeypatch.chdir(draft)  # ../v_llama is looked up from here: tmp_path/drafts/v_llama, absent
    status, lines = validate_cli(draft, capsys)
    assert status == 0
    assert any(
        "verifier checks not run: ../v_llama does not exist; pass --verifier DIR" in line for line in lines
    )


def test_the_checks_run_again_once_the_verifier_is_given(bf16_draft, tmp_path, verifier, capsys):
    draft = mutate(bf16_draft, tmp_path / "draft", config_fn=naming(str(tmp_path / "gone")))
    status, lines = validate_cli(draft, capsys, "--verifier", str(verifier))
    assert status == 0 and not any("not run" in line for line in lines), lines


def test_an_uncached_hub_verifier_gets_one_not_checked_line(bf16_draft, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    draft = mutate(bf16_draft, tmp_path / "draft", config_fn=naming("example-org/tiny-llama"))
    status, lines = validate_cli(draft, capsys)
    assert status == 0
    found = [line for line in lines if "verifier checks not run" in line]
    assert len(found) == 1, lines
    assert "example-org/tiny-llama is a hub id not in the local Hugging Face cache" in found[0]
    assert "--verifier DIR" in found[0]


def test_a_verifier_directory_without_config_json_is_said(bf16_draft, tmp_path):
    empty = tmp_path / "v_empty"
    empty.mkdir()
    draft = mutate(bf16_draft, tmp_path / "draft", config_fn=naming(str(empty)))
    messages = [f.message for f in validate_checkpoint(draft) if f.severity == "warning"]
    assert f"verifier checks not run: {empty} has no config.json; pass --verifier DIR" in " ".join(messages)


def test_a_local_verifier_is_still_read_and_checked(bf16_draft, tmp_path, verifier):
    """The verifier the draft names is read from disk: a wrong vocabulary is caught without --verifier."""

    def other_vocab(config: dict) -> None:
        config["transformer_layer_config"]["vocab_size"] = 2000

    draft = mutate(bf16_draft, tmp_path / "draft", config_fn=other_vocab)
    assert read_config(draft)["speculators_config"]["verifier"]["name_or_path"] == str(verifier)
    text = " ".join(f.message for f in errors(validate_checkpoint(draft)))
    assert "the verifier's vocab_size 1000" in text


# ---- damaged weight files ----------------------------------------------------------------------------------
def truncated(directory: Path) -> None:
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])


def garbage(directory: Path) -> None:
    (directory / "model.safetensors").write_bytes(b"\xff" * 64)


@pytest.mark.parametrize("damage", [truncated, garbage], ids=["truncated", "garbage"])
def test_validate_names_a_damaged_weight_file_and_the_fix(damage, bf16_draft, tmp_path, capsys):
    draft = mutate(bf16_draft, tmp_path / "draft")
    damage(draft)
    status, lines = validate_cli(draft, capsys)
    assert status == 1
    found = [line for line in lines if line.startswith("ERROR")]
    assert len(found) == 1, lines
    assert str(draft / "model.safetensors") in found[0] and UNREADABLE in found[0]


def test_validate_names_the_damaged_shard_of_a_sharded_checkpoint(bf16_draft, tmp_path):
    draft = mutate(bf16_draft, tmp_path / "draft")
    tensors = load_file(draft / "model.safetensors")
    (draft / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, held in shards.items():
        save_file({name: tensors[name] for name in held}, draft / shard, metadata={"format": "pt"})
    weight_map = {name: shard for shard, held in shards.items() for name in held}
    (draft / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert errors(validate_checkpoint(draft)) == []
    (draft / "model-00002-of-00002.safetensors").write_bytes(b"\x00" * 3)
    found = errors(validate_checkpoint(draft))
    assert len(found) == 1 and str(draft / "model-00002-of-00002.safetensors") in found[0].message
    assert UNREADABLE in found[0].message


@pytest.mark.parametrize("damage", [truncated, garbage], ids=["truncated", "garbage"])
def test_export_of_a_damaged_draft_is_one_error_line(damage, bf16_draft, tmp_path, capsys):
    draft = mutate(bf16_draft, tmp_path / "draft")
    damage(draft)
    assert cli_main(["export", str(draft), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert str(draft / "model.safetensors") in lines[0] and UNREADABLE in lines[0]
    assert not (tmp_path / "out").exists()
