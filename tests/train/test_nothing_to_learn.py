"""A run with nothing to learn is refused before its first step, naming the cause (issue 40).

* no trained position: a draft vocabulary that holds none of the verifier's targets (built here from the token
  counts of other data) trained a loss of 0 and moved nothing, silently;
* ``train.max_length`` shorter than a draft (drafted positions + 2) leaves the deepest steps nothing to train on;
* no ``heldout/`` split: the run never evaluated and wrote no ``best.json``, silently; refused unless the recipe
  holds out nothing on purpose (``data.heldout_fraction=0``), which is said.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from data_gen.store import TOKEN_COUNTS_NAME
from speculators import runs
from tests.train.conftest import compose, tiny_overrides
from train.objectives import train_settings
from train.settings import SettingsError
from train.trainer import train


def records(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / runs.METRICS_NAME
    lines = path.read_text().splitlines() if path.is_file() else []
    return [record for record in map(json.loads, lines) if record["kind"] == kind]


def test_a_draft_vocab_without_any_target_is_refused_before_the_first_step(
    sharp_verifier, tiny_data, tmp_path
):
    """The draft vocabulary is the most frequent tokens of ``token_counts.safetensors``; counts of other data (here:
    one token this data never has as an assistant token) give a vocabulary no target falls in."""
    data = Path(shutil.copytree(tiny_data, tmp_path / "data"))
    counts = load_file(str(data / TOKEN_COUNTS_NAME))["counts"]
    never = int(torch.nonzero(counts == 0)[0])
    other = torch.zeros_like(counts)
    other[never] = 100
    save_file({"counts": other}, str(data / TOKEN_COUNTS_NAME), metadata={"provenance": "{}"})
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(sharp_verifier, data, run_dir, "model.draft_vocab_size=1", "train.max_steps=2")
    with pytest.raises(ValueError, match=r"nothing to learn: the first global batch .*\(step 1\)") as refused:
        train(compose(overrides), run_dir)
    message = str(refused.value)
    assert "outside the draft vocabulary (model.draft_vocab_size=1: the most frequent" in message
    assert "train.mask_out_of_vocab=false" in message
    assert not records(run_dir, "train") and not runs.list_checkpoints(run_dir)


@pytest.mark.parametrize(
    ("recipe", "extra", "steps", "key"),
    [
        ("tiny_eagle3", (), 3, "train.ttt_steps"),
        ("tiny_dflash", (), 3, "block.block_size"),  # block 4: 3 drafted positions
        ("tiny_eagle3", ("train.ttt_steps=6",), 6, "train.ttt_steps"),
    ],
)
def test_rows_shorter_than_a_draft_are_refused_in_the_settings(
    sharp_verifier, tiny_data, tmp_path, recipe, extra, steps, key
):
    def settings(length: int):
        overrides = tiny_overrides(sharp_verifier, tiny_data, tmp_path, f"train.max_length={length}", *extra)
        overrides[0] = f"recipe={recipe}"
        return train_settings(compose(overrides))

    with pytest.raises(SettingsError) as refused:
        settings(steps + 1)
    message = str(refused.value)
    assert f"train.max_length={steps + 1}: rows shorter than {steps} drafted positions + 2" in message
    assert f"raise train.max_length to at least {steps + 2} or lower {key}" in message
    assert settings(steps + 2).train.max_length == steps + 2


def test_missing_heldout_data_is_refused_unless_the_recipe_holds_out_nothing(
    sharp_verifier, tiny_data, tmp_path, capsys
):
    data = Path(shutil.copytree(tiny_data, tmp_path / "data", ignore=shutil.ignore_patterns("heldout")))
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(sharp_verifier, data, run_dir, "train.max_steps=1")
    with pytest.raises(ValueError) as refused:
        train(compose(overrides), run_dir)
    message = str(refused.value)
    assert f"{data}/heldout is missing: this run would never evaluate" in message
    assert "data.heldout_fraction > 0" in message and "data.heldout_fraction=0" in message
    assert not run_dir.exists()  # refused before anything was written

    result = train(compose([*overrides, "data.heldout_fraction=0"]), run_dir)
    assert result["step"] == 1 and not records(run_dir, "eval") and not runs.read_best(run_dir)
    assert "no held-out data (data.heldout_fraction=0)" in capsys.readouterr().out
