"""Publishing: ``push_checkpoint`` validates, then drives ``HfApi``. The Hub is the one thing faked: a recorder
with HfApi's method signatures that copies what would be uploaded."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from huggingface_hub import HfApi

from speculators.export import push_checkpoint
from speculators.export.hub import default_commit_message
from tests.export.conftest import build_draft


class RecordingHfApi:
    """Records create_repo / create_branch / upload_folder calls; refuses arguments HfApi does not take."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.uploaded: dict[str, bytes] = {}

    def _record(self, name: str, kwargs: dict) -> None:
        inspect.signature(getattr(HfApi, name)).bind(None, **kwargs)  # TypeError on a wrong argument
        self.calls.append((name, kwargs))

    def create_repo(self, **kwargs):
        self._record("create_repo", kwargs)
        return f"https://huggingface.co/{kwargs['repo_id']}"

    def create_branch(self, **kwargs):
        self._record("create_branch", kwargs)

    def upload_folder(self, **kwargs):
        self._record("upload_folder", kwargs)
        folder = Path(kwargs["folder_path"])
        self.uploaded = {p.name: p.read_bytes() for p in folder.iterdir() if not p.name.startswith(".")}
        return SimpleNamespace(
            commit_url=f"https://huggingface.co/{kwargs['repo_id']}/commit/abc123", oid="abc123"
        )


@pytest.fixture
def published(tmp_path, small_verifier_dir) -> Path:
    """A valid checkpoint whose verifier is named by a hub id (what one publishes)."""
    draft = build_draft(small_verifier_dir, draft_vocab_size=256)
    out = draft.save_pretrained(tmp_path / "draft")
    config = json.loads((out / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = "example-org/tiny-llama"
    (out / "config.json").write_text(json.dumps(config))
    (out / "README.md").write_text("# card\n")
    return out


def test_push_uploads_the_validated_directory(published):
    api = RecordingHfApi()
    result = push_checkpoint(published, "me/tiny-eagle3", private=True, api=api)
    names = [name for name, _ in api.calls]
    assert names == ["create_repo", "upload_folder"]
    assert api.calls[0][1] == {
        "repo_id": "me/tiny-eagle3",
        "repo_type": "model",
        "private": True,
        "exist_ok": True,
    }
    upload = api.calls[1][1]
    assert upload["folder_path"] == str(published) and upload["revision"] is None
    assert upload["commit_message"] == default_commit_message(published)
    assert "example-org/tiny-llama" in upload["commit_message"]
    assert set(api.uploaded) == {"config.json", "model.safetensors", "README.md"}
    assert result.commit.oid == "abc123"


def test_push_to_a_revision_with_a_message(published):
    api = RecordingHfApi()
    push_checkpoint(published, "me/tiny-eagle3", revision="v2", commit_message="retrained", api=api)
    assert [name for name, _ in api.calls] == ["create_repo", "create_branch", "upload_folder"]
    assert api.calls[0][1]["private"] is False
    assert api.calls[1][1] == {
        "repo_id": "me/tiny-eagle3",
        "branch": "v2",
        "repo_type": "model",
        "exist_ok": True,
    }
    assert api.calls[2][1]["revision"] == "v2" and api.calls[2][1]["commit_message"] == "retrained"


def test_invalid_checkpoint_is_never_uploaded(published):
    config = json.loads((published / "config.json").read_text())
    config["model_type"] = "llama"
    (published / "config.json").write_text(json.dumps(config))
    api = RecordingHfApi()
    with pytest.raises(ValueError, match="top-level model_type"):
        push_checkpoint(published, "me/tiny-eagle3", api=api)
    assert api.calls == []


def test_local_verifier_path_is_refused_unless_allowed(tmp_path, small_verifier_dir):
    out = build_draft(small_verifier_dir, draft_vocab_size=256).save_pretrained(tmp_path / "local")
    api = RecordingHfApi()
    with pytest.raises(ValueError, match="--verifier-name"):
        push_checkpoint(out, "me/x", api=api)
    assert api.calls == []
    push_checkpoint(out, "me/x", allow_local_verifier=True, api=api)
    assert [name for name, _ in api.calls] == ["create_repo", "upload_folder"]


def test_real_hfapi_is_built_with_the_environment_token(published, monkeypatch):
    """Without an injected api the real HfApi is constructed with HF_TOKEN; its first network call is where the
    test stops (no network here), proving the real code path is the one that runs."""
    import huggingface_hub

    seen = {}

    class StopAtFirstCall(HfApi):
        def __init__(self, token=None, **kwargs):
            seen["token"] = token
            super().__init__(token=token, **kwargs)

        def create_repo(self, **kwargs):
            raise ConnectionError("no network in tests")

    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.setattr(huggingface_hub, "HfApi", StopAtFirstCall)
    with pytest.raises(ConnectionError):
        push_checkpoint(published, "me/tiny-eagle3")
    assert seen["token"] == "hf_test_token"


def test_cli_push_reports_refusal(published, capsys):
    from speculators.cli import main as cli_main

    shutil.rmtree(published / "model.safetensors", ignore_errors=True)
    (published / "model.safetensors").unlink(missing_ok=True)
    assert cli_main(["push", str(published), "me/tiny-eagle3"]) == 1
    assert "refusing to push" in capsys.readouterr().err
