"""The embedded verifier is SmolLM2 dequantized from a Q4_1 GGUF, not the published weights, and everything that
names it says so: its converted directory's model card (also added to a conversion cached before the card existed,
without converting again) and the model card of a draft exported for it."""

from __future__ import annotations

import json

from speculators.export import export_checkpoint
from speculators.verifier import (
    EMBEDDED_CARD,
    EMBEDDED_DIRNAME,
    EMBEDDED_WEIGHTS_NOTE,
    embedded_verifier_dir,
    embedded_weights_note,
)
from tests.export.conftest import build_draft, make_run


def test_converted_embedded_verifier_says_whose_weights_it_holds(smollm2_dir):
    card = (smollm2_dir / EMBEDDED_CARD).read_text()
    assert EMBEDDED_WEIGHTS_NOTE in card and "Q4_1 GGUF" in card and "not the published" in card
    assert embedded_weights_note(smollm2_dir) == EMBEDDED_WEIGHTS_NOTE
    assert (
        "dequantized" not in (smollm2_dir / "config.json").read_text()
    )  # the data-gen fingerprint is unchanged


def test_an_older_cached_conversion_gets_the_card_without_converting_again(tmp_path):
    cached = tmp_path / EMBEDDED_DIRNAME
    cached.mkdir()
    (cached / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (cached / "model.safetensors").write_bytes(b"converted earlier")
    assert embedded_weights_note(cached) is None
    assert embedded_verifier_dir(tmp_path) == cached
    assert embedded_weights_note(cached) == EMBEDDED_WEIGHTS_NOTE
    assert (cached / "model.safetensors").read_bytes() == b"converted earlier"  # not converted again
    assert sorted(p.name for p in cached.iterdir()) == sorted(
        ["config.json", "model.safetensors", EMBEDDED_CARD]
    )


def test_exported_model_card_says_the_verifier_is_the_dequantized_one(tmp_path, smollm2_dir, verifier_dir):
    draft = build_draft(smollm2_dir, draft_vocab_size=256)
    run = make_run(tmp_path / "run", "smollm2", {5: draft}, best_step=5, speculative_tokens=2)
    card = (export_checkpoint(run, tmp_path / "out").out_dir / "README.md").read_text()
    assert f"| verifier weights | {EMBEDDED_WEIGHTS_NOTE} |" in card
    assert "**Verifier weights:**" in card

    other = make_run(tmp_path / "tiny-run", str(verifier_dir), {5: build_draft(verifier_dir)}, best_step=5)
    plain_card = (export_checkpoint(other, tmp_path / "tiny-out").out_dir / "README.md").read_text()
    assert "verifier weights" not in plain_card.lower()
