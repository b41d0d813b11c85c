"""``speculators push`` publishes only what a downloader can serve: a verifier named by hub id (a relative local
path resolves on nobody else's machine any more than an absolute one) and weights in a dtype the consumers load.
The Hub is the one thing faked (``RecordingHfApi``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculators.cli import main as cli_main
from speculators.export import push_checkpoint
from tests.export.conftest import build_draft
from tests.export.test_push import RecordingHfApi


@pytest.fixture
def draft(tmp_path, small_verifier_dir, monkeypatch) -> Path:
    """A valid bf16 draft; the working directory is an empty one, so no relative name exists by accident."""
    out = build_draft(small_verifier_dir, draft_vocab_size=256).save_pretrained(tmp_path / "drafts" / "d")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return out


def name_verifier(directory: Path, name: str) -> None:
    config = json.loads((directory / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = name
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("name", ["../v_llama", "./v", "models/foo/bar", "~/models/v_llama", ".."])
def test_a_relative_local_verifier_path_is_refused_unless_allowed(draft, name):
    name_verifier(draft, name)
    api = RecordingHfApi()
    with pytest.raises(ValueError) as refused:
        push_checkpoint(draft, "me/draft", api=api)
    message = str(refused.value)
    assert "\n" not in message and api.calls == []
    assert f"local path {name!r}" in message
    assert "--verifier-name <hub id of the verifier>" in message and "--allow-local-verifier" in message
    push_checkpoint(draft, "me/draft", allow_local_verifier=True, api=api)
    assert [call for call, _ in api.calls] == ["create_repo", "upload_folder"]


def test_a_bare_name_that_exists_beside_the_draft_is_local(draft):
    """``v_llama`` has a hub id's shape, but a directory of that name sits beside the draft's files: it is the
    verifier the user exported against, not a hub repository."""
    (draft / "v_llama").mkdir()
    (draft / "v_llama" / "config.json").write_text("{}")
    name_verifier(draft, "v_llama")
    with pytest.raises(ValueError, match="local path 'v_llama'"):
        push_checkpoint(draft, "me/draft", api=RecordingHfApi())


@pytest.mark.parametrize("name", ["meta-llama/Llama-3.1-8B-Instruct", "gpt2", "Qwen/Qwen3-8B"])
def test_a_hub_id_verifier_is_pushed(draft, name):
    name_verifier(draft, name)
    api = RecordingHfApi()
    push_checkpoint(draft, "me/draft", api=api)
    assert [call for call, _ in api.calls] == ["create_repo", "upload_folder"]


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64])
def test_weights_of_a_dtype_consumers_do_not_load_are_refused_in_one_line(draft, dtype):
    name_verifier(draft, "example-org/tiny-llama")
    tensors = load_file(draft / "model.safetensors")
    tensors["fc.weight"] = tensors["fc.weight"].to(dtype)
    save_file(tensors, draft / "model.safetensors")
    api = RecordingHfApi()
    with pytest.raises(ValueError) as refused:
        push_checkpoint(draft, "me/draft", api=api)
    message = str(refused.value)
    assert "\n" not in message and api.calls == []
    assert message.startswith(f"refusing to push {draft}")
    dtype_name = str(dtype).removeprefix("torch.")
    assert f"fc.weight has dtype {dtype_name}" in message
    assert "re-export with `speculators export --dtype bfloat16`" in message


def test_cli_push_of_a_relative_verifier_is_one_error_line(draft, capsys):
    """Through the command line: refused before any Hub client is built (nothing here can reach a hub)."""
    name_verifier(draft, "../v_llama")
    assert cli_main(["push", str(draft), "me/draft"]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "'../v_llama'" in lines[0] and "--allow-local-verifier" in lines[0]
