"""The validator accepts a good checkpoint and rejects each known-bad one with a message that names the fix."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculators.algorithms.eagle3.model import Eagle3DraftModel
from speculators.cli import main as cli_main
from speculators.format import validate_checkpoint
from speculators.format.checkpoint import read_config
from speculators.format.validate import errors

from .test_roundtrip import build_draft


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory, tiny_llama_dir) -> Path:
    model = build_draft(tiny_llama_dir, draft_vocab_size=512)
    return model.save_pretrained(tmp_path_factory.mktemp("good") / "draft", dtype=torch.float32)


def mutate(
    src: Path,
    dst: Path,
    config_fn: Callable[[dict], None] | None = None,
    tensors_fn: Callable[[dict], None] | None = None,
) -> Path:
    shutil.copytree(src, dst)
    if config_fn:
        config = json.loads((dst / "config.json").read_text())
        config_fn(config)
        (dst / "config.json").write_text(json.dumps(config))
    if tensors_fn:
        tensors = load_file(dst / "model.safetensors")
        tensors_fn(tensors)
        save_file(tensors, dst / "model.safetensors")
    return dst


def error_text(directory: Path, verifier_dir: Path) -> str:
    found = errors(validate_checkpoint(directory, read_config(verifier_dir)))
    return "\n".join(str(f) for f in found)


def test_good_checkpoint_has_no_findings(good_checkpoint, tiny_llama_dir):
    assert validate_checkpoint(good_checkpoint, read_config(tiny_llama_dir)) == []
    assert cli_main(["validate", str(good_checkpoint), "--verifier", str(tiny_llama_dir)]) == 0


def _set(path: str, value):
    def apply(config: dict) -> None:
        *parents, leaf = path.split(".")
        node = config
        for key in parents:
            node = node[key] if not key.isdigit() else node[int(key)]
        node[leaf] = value

    return apply


def _delete(path: str):
    def apply(config: dict) -> None:
        *parents, leaf = path.split(".")
        node = config
        for key in parents:
            node = node[key] if not key.isdigit() else node[int(key)]
        del node[leaf]

    return apply


def _rename_all_with_model_prefix(tensors: dict) -> None:
    for name in list(tensors):
        tensors["model." + name] = tensors.pop(name)


def _d2t_as_ids(tensors: dict) -> None:
    tensors["d2t"] = tensors["d2t"] + torch.arange(tensors["d2t"].shape[0])


def _d2t_as_ids_in_range(tensors: dict) -> None:
    """d2t holding ids whose offset reading stays inside the vocabulary: only t2d's disagreement gives it away."""
    ids = torch.arange(0, 2 * tensors["d2t"].shape[0], 2)
    tensors["d2t"] = ids.clone()
    tensors["t2d"] = torch.zeros_like(tensors["t2d"])
    tensors["t2d"][ids] = True


def _nan_in_fc(tensors: dict) -> None:
    tensors["fc.weight"][0, 0] = float("nan")


def _t2d_off_by_one(tensors: dict) -> None:
    kept = tensors["t2d"].nonzero().flatten()
    tensors["t2d"][kept[0]] = False
    tensors["t2d"][kept[-1] + 1] = True


BAD_CASES = {
    "top_level_model_type": (_set("model_type", "llama"), None, "top-level model_type"),
    "vocab_not_verifier": (_set("transformer_layer_config.vocab_size", 32000), None, "verifier's vocab_size"),
    "no_layer_config": (_delete("transformer_layer_config"), None, "transformer_layer_config is missing"),
    "no_layer_model_type": (_delete("transformer_layer_config.model_type"), None, "model_type is missing"),
    "no_speculative_tokens": (
        _delete("speculators_config.proposal_methods.0.speculative_tokens"),
        None,
        "speculative_tokens",
    ),
    "no_norm_before_residual": (_delete("norm_before_residual"), None, "norm_before_residual is missing"),
    "no_default_method": (
        _delete("speculators_config.default_proposal_method"),
        None,
        "default_proposal_method",
    ),
    "no_verifier_architectures": (
        _delete("speculators_config.verifier.architectures"),
        None,
        "verifier.architectures",
    ),
    "eagle1_type": (_set("speculators_model_type", "eagle"), None, "not servable"),
    "aux_ids_out_of_range": (_set("eagle_aux_hidden_state_layer_ids", [2, 3, 9]), None, "outside [0, 8]"),
    "aux_ids_repeated": (_set("eagle_aux_hidden_state_layer_ids", [2, 4, 4]), None, "repeated or unsorted"),
    "aux_ids_unsorted": (_set("eagle_aux_hidden_state_layer_ids", [4, 2, 5]), None, "repeated or unsorted"),
    "model_prefix": (None, _rename_all_with_model_prefix, "'model.' prefix"),
    "d2t_as_ids": (None, _d2t_as_ids, "store offsets"),
    "d2t_as_ids_in_range": (None, _d2t_as_ids_in_range, "store offsets"),
    "missing_embed_tokens": (None, lambda t: t.pop("embed_tokens.weight"), "embed_tokens.weight is missing"),
    "nan_weights": (None, _nan_in_fc, "NaN or Inf"),
    "t2d_inconsistent": (None, _t2d_off_by_one, "inconsistent with d2t"),
    "wrong_shape": (None, lambda t: t.update({"fc.weight": torch.zeros(64, 128)}), "fc.weight has shape"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_rejects_known_bad_checkpoint(case, good_checkpoint, tiny_llama_dir, tmp_path, capsys):
    config_fn, tensors_fn, expected = BAD_CASES[case]
    bad = mutate(good_checkpoint, tmp_path / case, config_fn, tensors_fn)
    text = error_text(bad, tiny_llama_dir)
    assert expected in text, text
    assert cli_main(["validate", str(bad), "--verifier", str(tiny_llama_dir)]) == 1
    assert "error(s)" in capsys.readouterr().out


def _every_second_id(vocab: int, size: int) -> torch.Tensor:
    return torch.arange(1, 2 * size, 2)


def _every_second_id_up_to_the_last(vocab: int, size: int) -> torch.Tensor:
    return torch.arange(vocab - 2 * size + 1, vocab, 2)


UNUSUAL_VOCABULARIES = {  # (draft vocab size or None for the verifier's, kept ids from (vocab, size))
    "sparse_ids": (512, _every_second_id),
    "sparse_ids_with_the_last_id": (512, _every_second_id_up_to_the_last),
    "last_ids_of_the_vocabulary": (512, lambda vocab, size: torch.arange(vocab - size, vocab)),
    "single_id": (1, lambda vocab, size: torch.tensor([7])),
    "single_last_id": (1, lambda vocab, size: torch.tensor([vocab - 1])),
    "full_vocabulary": (None, lambda vocab, size: torch.arange(vocab)),
}


@pytest.mark.parametrize("case", sorted(UNUSUAL_VOCABULARIES))
def test_accepts_valid_but_unusual_vocabularies(case, tiny_llama_dir, tmp_path):
    """d2t offsets that look like ids (every second id: d2t[i] = i + 1) are still valid offsets; the validator must
    accept every mapping our library (and vLLM, which reads the same offsets) loads."""
    vocab = read_config(tiny_llama_dir)["vocab_size"]
    size, kept_ids = UNUSUAL_VOCABULARIES[case]
    size = size or vocab
    ids = kept_ids(vocab, size)
    model = build_draft(tiny_llama_dir, draft_vocab_size=size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    model.set_vocab(ids - torch.arange(size), t2d)
    directory = model.save_pretrained(tmp_path / case, dtype=torch.float32)
    assert validate_checkpoint(directory, read_config(tiny_llama_dir)) == []
    loaded = Eagle3DraftModel.from_pretrained(directory)
    assert torch.equal(loaded.draft_to_target(torch.arange(size)), ids)  # and it means what we wrote


def test_missing_config_is_one_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    found = validate_checkpoint(tmp_path / "empty")
    assert len(found) == 1 and "config.json" in found[0].file and found[0].severity == "error"


def test_cli_runs_as_module(good_checkpoint, tiny_llama_dir):
    import subprocess
    import sys

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "speculators",
            "validate",
            str(good_checkpoint),
            "--verifier",
            str(tiny_llama_dir),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "0 error(s)" in result.stdout


@pytest.mark.parametrize(
    "ids,expected",
    [
        ([-1, 3, 5], "negative ids [-1]"),
        ([-3, -2, -1], "negative ids [-3, -2, -1]"),
        ([True, 3, 5], "booleans"),
    ],
    ids=["minus-one-first", "all-negative", "boolean"],
)
def test_impossible_aux_ids_are_rejected_without_the_verifier(
    ids, expected, good_checkpoint, tmp_path, capsys
):
    """A hub-id verifier is never read, so the [0, L] range check cannot run; ids no verifier could make valid are
    still refused. vLLM captures the stream entering layer k only for k in [0, L]: -1 would never be captured."""

    def hub_verifier_with(config: dict) -> None:
        config["speculators_config"]["verifier"]["name_or_path"] = "meta-llama/Llama-3.1-8B-Instruct"
        config["eagle_aux_hidden_state_layer_ids"] = ids

    bad = mutate(good_checkpoint, tmp_path / "bad", hub_verifier_with)
    text = "\n".join(str(f) for f in errors(validate_checkpoint(bad)))
    assert expected in text and "eagle_aux_hidden_state_layer_ids" in text, text
    assert cli_main(["validate", str(bad)]) == 1
    assert "1 error(s)" in capsys.readouterr().out


def test_validate_names_a_verifier_directory_as_a_model_in_its_first_line(tiny_llama_dir, capsys):
    assert cli_main(["validate", str(tiny_llama_dir)]) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("ERROR") and "this is a model (llama), not a speculators draft" in first


def test_ids_above_the_layer_count_are_caught_for_a_hub_verifier_in_the_local_cache(
    good_checkpoint, tiny_llama_dir, tmp_path, monkeypatch
):
    """vLLM never captures an id above L. A hub-id verifier's L is read from the local Hugging Face cache when it
    is there (nothing is downloaded); with an empty cache the bound cannot be known and is not guessed."""

    def hub_verifier(config: dict) -> None:
        config["speculators_config"]["verifier"]["name_or_path"] = "example-org/tiny-llama"
        config["eagle_aux_hidden_state_layer_ids"] = [2, 3, 9]

    bad = mutate(good_checkpoint, tmp_path / "bad", hub_verifier)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert errors(validate_checkpoint(bad)) == []
    snapshot = tmp_path / "hub" / "models--example-org--tiny-llama" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    shutil.copy(tiny_llama_dir / "config.json", snapshot / "config.json")
    (tmp_path / "hub" / "models--example-org--tiny-llama" / "refs").mkdir()
    (tmp_path / "hub" / "models--example-org--tiny-llama" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    text = "\n".join(str(f) for f in errors(validate_checkpoint(bad)))
    assert "[9] are outside [0, 8]" in text, text
