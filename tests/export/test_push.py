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

from speculators.export import export_checkpoint, push_checkpoint
from speculators.export.hub import default_commit_message
from speculators.local_paths import find_local_paths
from tests.export.conftest import build_draft, make_run


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
        self.uploaded = {
            p.relative_to(folder).as_posix(): p.read_bytes()
            for p in folder.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
        }
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


def assert_no_local_path_uploaded(api: RecordingHfApi, *private: Path) -> None:
    """Every uploaded file, read whole (a safetensors header included): none of the ``private`` directories, and
    no absolute local path at all."""
    assert api.uploaded
    for name, data in api.uploaded.items():
        text = data.decode("utf-8", errors="replace")
        for directory in private:
            assert str(directory) not in text, f"{name} holds {directory}"
        assert find_local_paths(text) == [], (name, find_local_paths(text))


def test_pushed_export_names_models_by_hub_id_and_leaks_no_local_path(tmp_path, small_verifier_dir):
    """A real export of a run whose recipe, eval results and prompts all carry absolute paths (as a real run's
    resolved recipe does), re-exported with a hub id, pushes without a single local path in any file."""
    run = tmp_path / "runs" / "eagle3_tiny"
    make_run(
        run,
        str(small_verifier_dir),
        {10: build_draft(small_verifier_dir, draft_vocab_size=256)},
        best_step=10,
        extra_recipe={
            "run_dir": str(run),
            "train": {"data_dir": str(run / "data"), "init_from": str(tmp_path / "stage1" / "checkpoints")},
            "data": {"name": "sharegpt_builtin", "path": str(tmp_path / "chats.jsonl")},
        },
    )
    results = tmp_path / "evals" / "results.json"
    results.parent.mkdir()
    results.write_text(
        json.dumps(
            {
                "draft": str(tmp_path / "export"),
                "verifier": str(small_verifier_dir),
                "prompts": {"source": str(tmp_path / "prompts.jsonl"), "count": 2},
                "settings": {"max_new_tokens": 8, "temperature": 0, "dtype": "float32", "device": "cpu"},
                "runs": [{"name": "chain-k3", "method": "chain", "k": 3, "acceptance_length_global": 1.5}],
            }
        )
    )
    out = tmp_path / "export"
    export_checkpoint(run, out, verifier_name="example-org/tiny-llama", eval_results=results)
    card = (out / "README.md").read_text()
    assert "draft for `example-org/tiny-llama`" in card  # the hub id the user gave
    assert "vllm serve example-org/tiny-llama" in card
    assert "data_dir: data" in card and "run_dir: ." in card  # relative to the run
    assert "init_from: <local>/checkpoints" in card and "path: <local>/chats.jsonl" in card
    assert "(`<local>/results.json`)" in card and "prompts from `<local>/prompts.jsonl`" in card

    api = RecordingHfApi()
    push_checkpoint(out, "me/tiny-eagle3", api=api)
    assert {"README.md", "config.json", "model.safetensors"} <= set(api.uploaded)
    assert_no_local_path_uploaded(api, tmp_path, small_verifier_dir, Path.home())


@pytest.mark.parametrize(
    "name,content",
    [
        ("README.md", "# card\n\nre-exported from `/home/alice/runs/eagle3/export`\n"),
        ("eval/results.json", json.dumps({"draft": "/root/.cache/drafts/x", "runs": []})),
        ("memory_plan.json", json.dumps({"verifier_config": "C:\\Users\\bob\\config.json"})),
    ],
    ids=["card", "nested-results", "windows-plan"],
)
def test_push_refuses_any_file_with_a_local_path_unless_allowed(published, name, content):
    (published / name).parent.mkdir(exist_ok=True)
    (published / name).write_text(content)
    api = RecordingHfApi()
    with pytest.raises(ValueError, match=f"(?s){name}: .*--allow-local-paths") as refused:
        push_checkpoint(published, "me/tiny-eagle3", api=api)
    assert "refusing to push" in str(refused.value) and api.calls == []
    push_checkpoint(published, "me/tiny-eagle3", allow_local_paths=True, api=api)
    assert name in api.uploaded


def test_every_pushed_file_of_the_fixture_is_clean(published):
    api = RecordingHfApi()
    push_checkpoint(published, "me/tiny-eagle3", api=api)
    assert_no_local_path_uploaded(api, published)
