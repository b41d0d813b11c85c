"""``architectures`` is legal when any producer the consumers load writes it: ours (``PEagleSpeculator``) and the
speculators package's ``save_pretrained`` (the model class, ``PEagleDraftModel``). The validator must not warn on the
reference's own files, and for a type it declares no unit for it must not name EAGLE-3's class."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from speculators.algorithms.dflash.config import DFlashConfig
from speculators.algorithms.dflash2.config import DFlash2Config
from speculators.algorithms.dspark.config import DSparkConfig
from speculators.algorithms.eagle3.config import Eagle3Config
from speculators.algorithms.peagle.config import PEagleConfig
from speculators.format import validate_checkpoint
from speculators.format.checkpoint import read_config

# (type, how its config is built from the verifier, the class speculators 0.9.0's save_pretrained writes)
REFERENCE_FILES = {
    "eagle3": (lambda v, name: Eagle3Config.from_verifier(v, name, draft_vocab_size=512), "Eagle3DraftModel"),
    "peagle": (lambda v, name: PEagleConfig.from_verifier(v, name, mask_token_id=0), "PEagleDraftModel"),
    "dflash": (lambda v, name: DFlashConfig.from_verifier(v, name, mask_token_id=0), "DFlashDraftModel"),
    "dspark": (lambda v, name: DSparkConfig.from_verifier(v, name, mask_token_id=0), "DSparkDraftModel"),
    "dflash2": (lambda v, name: DFlash2Config.from_verifier(v, name, mask_token_id=0), "DFlash2DraftModel"),
}


def config_of(model_type: str, verifier_dir: Path) -> dict[str, Any]:
    build, _ = REFERENCE_FILES[model_type]
    return build(read_config(verifier_dir), str(verifier_dir)).to_dict()


def architecture_warnings(config: dict[str, Any], directory: Path, verifier_dir: Path) -> list[str]:
    """The findings about ``architectures`` of ``config`` written to ``directory`` (weights are not read)."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    found = validate_checkpoint(directory, read_config(verifier_dir), check_weights=False)
    return [f.message for f in found if f.message.startswith("architectures")]


@pytest.mark.parametrize("model_type", sorted(REFERENCE_FILES))
def test_the_reference_packages_class_name_is_not_warned_about(model_type, tiny_llama_dir, tmp_path):
    config = config_of(model_type, tiny_llama_dir)
    assert architecture_warnings(config, tmp_path / "ours", tiny_llama_dir) == []
    config["architectures"] = [REFERENCE_FILES[model_type][1]]
    assert architecture_warnings(config, tmp_path / "reference", tiny_llama_dir) == []


def test_a_wrong_string_is_warned_about_with_the_types_own_names(tiny_llama_dir, tmp_path):
    config = config_of("peagle", tiny_llama_dir)
    config["architectures"] = ["Eagle3Speculator"]
    (message,) = architecture_warnings(config, tmp_path / "draft", tiny_llama_dir)
    assert '["PEagleSpeculator"]' in message and '["PEagleDraftModel"]' in message
    assert "'peagle'" in message


def test_a_type_without_a_unit_is_never_told_eagle3s_name(tiny_llama_dir, tmp_path, monkeypatch):
    """A type vLLM serves that no unit declares (none today, so one is made up) is checked on its shared keys only."""
    from speculators.format import validate

    monkeypatch.setattr(validate, "UNDECLARED_SERVABLE_TYPES", ("dflash9",))
    config = config_of("dflash", tiny_llama_dir)
    config.update(speculators_model_type="dflash9", architectures=["DFlash9DraftModel"])
    config["speculators_config"]["algorithm"] = "dflash9"
    directory = tmp_path / "dflash9"
    architecture_warnings(config, directory, tiny_llama_dir)
    found = validate_checkpoint(directory, read_config(tiny_llama_dir), check_weights=False)
    assert not any("Eagle3" in f.message for f in found), found
    assert any("no declared unit" in f.message for f in found)  # said once: its own keys went unchecked
