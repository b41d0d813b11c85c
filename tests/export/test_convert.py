"""Conversion from other layouts: original EAGLE-3, SpecForge, older/newer speculators configs; EAGLE-1/HASS is
explained, never exported. Each converted checkpoint validates and loads into our draft with identical tensors."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculators.algorithms.eagle3.model import Eagle3DraftModel
from speculators.cli import main as cli_main
from speculators.export import (
    ExportWarning,
    UnsupportedDraftError,
    convert_checkpoint,
    detect_layout,
    export_checkpoint,
)
from speculators.export.sources import read_config, read_weights
from speculators.export.writer import InvalidCheckpointError
from speculators.format import load_checkpoint, validate_checkpoint
from speculators.format.validate import errors
from speculators.verifier import verifier_embedding
from tests.export.conftest import (
    build_draft,
    draft_logits,
    state_dict_of,
    write_eagle3_original,
    write_specforge,
)
from tests.support.verifiers import build_tiny_verifier

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}

# Each test asserts the warnings it cares about with pytest.warns; the rest are expected noise here.
pytestmark = pytest.mark.filterwarnings("ignore::speculators.export.ExportWarning")


@pytest.fixture(scope="module")
def original_draft(small_verifier_dir) -> Eagle3DraftModel:
    """An original-EAGLE-3-semantics draft (residual = un-normed hidden) whose embedding is the verifier's."""
    model = build_draft(small_verifier_dir, draft_vocab_size=256, seed=3, norm_before_residual=False)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(verifier_embedding(small_verifier_dir))
    return model


def verifier_config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


def assert_same_draft(out: Path, source: Eagle3DraftModel) -> None:
    """The converted checkpoint validates, loads into Eagle3DraftModel tensor-for-tensor and computes the same."""
    config = json.loads((out / "config.json").read_text())
    verifier = verifier_config(Path(config["speculators_config"]["verifier"]["name_or_path"]))
    assert errors(validate_checkpoint(out, verifier)) == []
    loaded = Eagle3DraftModel.from_pretrained(out, dtype=torch.float32)
    expected = state_dict_of(source)
    for name, tensor in state_dict_of(loaded).items():
        assert torch.equal(tensor, expected[name]), name
    assert torch.equal(draft_logits(loaded), draft_logits(source))


# ---- original EAGLE-3 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("as_bin", [True, False], ids=["pytorch_model.bin", "model.safetensors"])
def test_original_eagle3_layout_converts(tmp_path, original_draft, small_verifier_dir, as_bin):
    src = write_eagle3_original(tmp_path / "src", original_draft, as_bin=as_bin)
    assert detect_layout(read_config(src), read_weights(src)) == "eagle3-original"
    with pytest.warns(ExportWarning, match="embed_tokens.weight was missing"):
        result = convert_checkpoint(src, tmp_path / "out", verifier=str(small_verifier_dir), dtype="float32")
    assert result.layout == "eagle3-original"
    config, tensors = load_checkpoint(tmp_path / "out")
    assert "model_type" not in config and config["architectures"] == ["Eagle3Speculator"]
    assert config["norm_before_residual"] is False  # EAGLE-3's layer 0 adds the un-normed hidden state
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM's default for L = 8, no shift
    assert config["transformer_layer_config"]["max_position_embeddings"] == 1024  # the verifier's, not 256
    assert config["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert not any(n.startswith("midlayer.") for n in tensors)
    assert_same_draft(tmp_path / "out", original_draft)


def test_original_layout_in_bf16_and_top_level_ids_shifted_on_request(
    tmp_path, original_draft, small_verifier_dir
):
    src = write_eagle3_original(tmp_path / "src", original_draft)
    config = read_config(src)
    config["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]
    (src / "config.json").write_text(json.dumps(config))
    with pytest.warns(ExportWarning, match=r"output-of-layer.*\[2, 4, 5\]"):
        convert_checkpoint(
            src, tmp_path / "out", verifier=str(small_verifier_dir), aux_convention="output-of-layer"
        )
    out_config, tensors = load_checkpoint(tmp_path / "out")
    assert out_config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert tensors["fc.weight"].dtype == torch.bfloat16 and out_config["torch_dtype"] == "bfloat16"
    assert torch.equal(tensors["fc.weight"], original_draft.fc.weight.detach().to(torch.bfloat16))


def test_verifier_rope_scaling_is_copied(tmp_path, original_draft):
    verifier = build_tiny_verifier(
        tmp_path / "llama31-like", vocab_size=1000, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING
    )
    src = write_specforge(tmp_path / "src", original_draft)  # says rope_theta 10000, rope_scaling null
    with pytest.warns(ExportWarning, match="rope settings"):
        convert_checkpoint(src, tmp_path / "out", verifier=str(verifier))
    layer = load_checkpoint(tmp_path / "out")[0]["transformer_layer_config"]
    assert layer["rope_theta"] == 500000.0 and layer["rope_scaling"]["rope_type"] == "llama3"
    assert layer["rope_scaling"]["factor"] == 8.0


# ---- SpecForge ---------------------------------------------------------------------------------------------
def test_specforge_layout_shifts_output_of_layer_ids(tmp_path, original_draft, small_verifier_dir):
    src = write_specforge(tmp_path / "src", original_draft, aux_ids=[1, 3, 4])  # SpecForge's [1, L//2-1, L-4]
    assert detect_layout(read_config(src), read_weights(src)) == "specforge"
    with pytest.warns(ExportWarning, match=r"shifted by \+1 .*\[2, 4, 5\]"):
        convert_checkpoint(src, tmp_path / "out", verifier=str(small_verifier_dir), dtype="float32")
    config = load_checkpoint(tmp_path / "out")[0]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["norm_before_residual"] is False
    assert_same_draft(tmp_path / "out", original_draft)


def test_specforge_ids_kept_when_declared_vllm_convention(
    tmp_path, original_draft, small_verifier_dir, recwarn
):
    src = write_specforge(tmp_path / "src", original_draft, aux_ids=[2, 4, 5])
    convert_checkpoint(src, tmp_path / "out", verifier=str(small_verifier_dir), aux_convention="vllm")
    assert load_checkpoint(tmp_path / "out")[0]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert not [w for w in recwarn if "shifted" in str(w.message)]


def test_specforge_without_ids_gets_vllm_default(tmp_path, original_draft, small_verifier_dir):
    src = write_specforge(tmp_path / "src", original_draft)
    with pytest.warns(ExportWarning):
        convert_checkpoint(src, tmp_path / "out", verifier=str(small_verifier_dir))
    assert load_checkpoint(tmp_path / "out")[0]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]


def test_out_of_range_aux_ids_are_refused(tmp_path, original_draft, small_verifier_dir):
    src = write_specforge(tmp_path / "src", original_draft, aux_ids=[1, 3, 8])  # 8 + 1 > L = 8
    with pytest.warns(ExportWarning), pytest.raises(ValueError, match=r"\[9\] fall outside \[0, 8\]"):
        convert_checkpoint(src, tmp_path / "out", verifier=str(small_verifier_dir))
    assert not (tmp_path / "out").exists()


def test_flat_layouts_need_a_verifier(tmp_path, original_draft):
    src = write_specforge(tmp_path / "src", original_draft)
    with pytest.raises(ValueError, match="pass --verifier"):
        convert_checkpoint(src, tmp_path / "out")


# ---- speculators format, older and newer -------------------------------------------------------------------
def make_old_speculators(directory: Path, model: Eagle3DraftModel) -> Path:
    """An older speculators export: no norm_before_residual, no layer model_type, a top-level model_type,
    ``model.``-prefixed names and d2t stored as target ids."""
    model.save_pretrained(directory, dtype=torch.float32)
    config = read_config(directory)
    del config["norm_before_residual"]
    del config["transformer_layer_config"]["model_type"]
    config["model_type"] = "llama"
    (directory / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["d2t"] = tensors["d2t"] + torch.arange(tensors["d2t"].shape[0])
    save_file({"model." + k: v for k, v in tensors.items()}, str(directory / "model.safetensors"))
    return directory


def test_older_speculators_config_is_normalised(tmp_path, small_verifier_dir):
    model = build_draft(small_verifier_dir, draft_vocab_size=256, seed=5)  # trained with norm_before_residual
    src = make_old_speculators(tmp_path / "src", model)
    assert errors(validate_checkpoint(src))  # the consumers would reject or misread it
    with pytest.raises(ValueError, match="--norm-before-residual"):
        convert_checkpoint(src, tmp_path / "out")
    with pytest.warns(ExportWarning) as caught:
        convert_checkpoint(src, tmp_path / "out", norm_before_residual=True, dtype="float32")
    messages = " ".join(str(w.message) for w in caught)
    for expected in (
        "top-level model_type",
        "model_type was missing",
        "prefix 'model.'",
        "d2t holds target ids",
    ):
        assert expected in messages, expected
    config, tensors = load_checkpoint(tmp_path / "out")
    assert (
        config["transformer_layer_config"]["model_type"] == "llama" and config["norm_before_residual"] is True
    )
    assert torch.equal(tensors["d2t"], model.d2t)  # offsets again
    assert_same_draft(tmp_path / "out", model)


def test_a_norm_flag_the_draft_was_trained_with_is_kept_in_every_mode(tmp_path, small_verifier_dir):
    """EAGLE-3.1's flags (speculators 0.9.0's default): the default max-compat form keeps a flag the weights need,
    with a warning naming the consumers that read it, as --flags keep does silently; an absent flag is false."""
    model = build_draft(small_verifier_dir, draft_vocab_size=256, seed=6)
    config = copy.deepcopy(model.config)
    config.norm_before_fc = True
    newer = Eagle3DraftModel(config)
    newer.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        newer.input_norm.weight.uniform_(0.5, 1.5)
    newer.save_pretrained(tmp_path / "src", dtype=torch.float32)
    with pytest.warns(
        ExportWarning, match=r"kept \['norm_before_fc'\] true.*vLLM 0.32 and speculators 0.9.0"
    ):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", dtype="float32")
    converted = load_checkpoint(tmp_path / "out")[0]
    assert converted["norm_before_fc"] is True and converted["norm_output"] is False
    assert_same_draft(tmp_path / "out", newer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_checkpoint(tmp_path / "src", tmp_path / "kept", flags="keep", dtype="float32")
    assert not [w for w in caught if "kept [" in str(w.message)]
    assert load_checkpoint(tmp_path / "kept")[0]["norm_before_fc"] is True
    assert_same_draft(tmp_path / "kept", newer)


def test_current_speculators_checkpoint_round_trips_unchanged(tmp_path, small_verifier_dir, recwarn):
    model = build_draft(small_verifier_dir, draft_vocab_size=256, seed=8)
    model.save_pretrained(tmp_path / "src", dtype=torch.float32)
    result = convert_checkpoint(tmp_path / "src", tmp_path / "out", dtype="float32")
    assert result.layout == "speculators" and not [w for w in recwarn if w.category is ExportWarning]
    assert read_config(tmp_path / "out") == {**read_config(tmp_path / "src"), "speculators_version": "0.1.0"}
    assert_same_draft(tmp_path / "out", model)


# ---- EAGLE-1 / HASS ----------------------------------------------------------------------------------------
def write_eagle1(directory: Path, hidden: int = 64, vocab: int = 1000) -> Path:
    """EAGLE-1/HASS layout: flat Llama config, fc [H, 2H] with bias over cat(embedding, feature), one plain decoder
    layer (q_proj reads H), no lm_head of its own."""
    directory.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
    }
    (directory / "config.json").write_text(json.dumps(config))
    tensors = {
        "fc.weight": torch.randn(hidden, 2 * hidden),
        "fc.bias": torch.randn(hidden),
        "embed_tokens.weight": torch.randn(vocab, hidden),
        "layers.0.self_attn.q_proj.weight": torch.randn(hidden, hidden),
        "layers.0.self_attn.k_proj.weight": torch.randn(32, hidden),
        "layers.0.self_attn.v_proj.weight": torch.randn(32, hidden),
        "layers.0.self_attn.o_proj.weight": torch.randn(hidden, hidden),
        "layers.0.post_attention_layernorm.weight": torch.ones(hidden),
        "layers.0.mlp.gate_proj.weight": torch.randn(128, hidden),
        "layers.0.mlp.up_proj.weight": torch.randn(128, hidden),
        "layers.0.mlp.down_proj.weight": torch.randn(hidden, 128),
    }
    torch.save(tensors, directory / "pytorch_model.bin")
    return directory


def test_eagle1_hass_checkpoint_gets_an_explanation(tmp_path, small_verifier_dir, capsys):
    src = write_eagle1(tmp_path / "hass")
    with pytest.raises(UnsupportedDraftError, match=r"EAGLE-1/HASS.*fc.weight \[64, 128\] = \[H, 2H\]"):
        convert_checkpoint(src, tmp_path / "out", verifier=str(small_verifier_dir))
    assert not (tmp_path / "out").exists()
    assert cli_main(["convert", str(src), str(tmp_path / "out"), "--verifier", str(small_verifier_dir)]) == 1
    err = capsys.readouterr().err
    assert "vLLM serves only the eagle3 family" in err and "train on the EAGLE-3 architecture" in err


def test_speculators_eagle_type_gets_the_same_explanation(tmp_path, small_verifier_dir):
    model = build_draft(small_verifier_dir, draft_vocab_size=256)
    model.save_pretrained(tmp_path / "src")
    config = read_config(tmp_path / "src")
    config["speculators_model_type"] = "eagle"
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedDraftError, match="speculators_model_type 'eagle'"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out")


def test_cli_convert(tmp_path, original_draft, small_verifier_dir, capsys):
    src = write_specforge(tmp_path / "src", original_draft, aux_ids=[1, 3, 4])
    args = [
        "convert",
        str(src),
        str(tmp_path / "out"),
        "--verifier",
        str(small_verifier_dir),
        "--from",
        "specforge",
    ]
    assert cli_main([*args, "--speculative-tokens", "5"]) == 0
    captured = capsys.readouterr()
    assert "converted" in captured.out and "shifted by +1" in captured.err
    config = load_checkpoint(tmp_path / "out")[0]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert "converted from the specforge layout" in (tmp_path / "out" / "README.md").read_text()


# ---- aux layer order ---------------------------------------------------------------------------------------
def test_unsorted_aux_ids_are_sorted_with_fc_permuted(tmp_path, small_verifier_dir):
    """vLLM concatenates aux states in ascending layer order: fc's column blocks must follow that order."""
    model = build_draft(small_verifier_dir, draft_vocab_size=256, seed=9, aux_layer_ids=[6, 1, 4])
    model.save_pretrained(tmp_path / "src", dtype=torch.float32)
    with pytest.warns(ExportWarning, match=r"not ascending.*\[1, 4, 6\]"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", dtype="float32")
    loaded = Eagle3DraftModel.from_pretrained(tmp_path / "out")
    assert loaded.config.eagle_aux_hidden_state_layer_ids == [1, 4, 6]
    states = {
        layer: torch.randn(1, 5, 64) for layer in (1, 4, 6)
    }  # the verifier's stream entering each layer
    ids, positions = torch.randint(0, 1000, (1, 5)), torch.arange(5)[None]
    with torch.no_grad():
        as_trained = model(
            ids, model.project_features(torch.cat([states[i] for i in (6, 1, 4)], -1)), positions
        )
        as_served = loaded(
            ids, loaded.project_features(torch.cat([states[i] for i in (1, 4, 6)], -1)), positions
        )
    torch.testing.assert_close(as_served[0], as_trained[0], rtol=1e-5, atol=1e-5)  # same sum, other order
    with torch.no_grad():
        unpermuted = model(
            ids, model.project_features(torch.cat([states[i] for i in (1, 4, 6)], -1)), positions
        )
    assert (
        unpermuted[0] - as_trained[0]
    ).abs().max() > 0.1  # what vLLM would compute without the permutation


def test_unsorted_aux_ids_permute_peagle_mask_hidden_too(tmp_path, small_verifier_dir):
    """P-EAGLE's ``mask_hidden`` stands in for the concatenated aux states, one block per aux layer in the config's
    order: when the export sorts the ids it must move with fc's columns, or every mask slot reads fc(a shuffled
    vector) and the served draft proposes other tokens than the trained one. Checked through the exporter (a
    trainer run) and the converter (a speculators-layout directory)."""
    from speculators.algorithms.peagle.config import PEagleConfig
    from speculators.algorithms.peagle.model import PEagleDraftModel
    from tests.export.conftest import make_run

    torch.manual_seed(4)
    config = PEagleConfig.from_verifier(
        read_config(small_verifier_dir), str(small_verifier_dir), mask_token_id=3, draft_vocab_size=1000,
        aux_layer_ids=[6, 1, 4], speculative_tokens=3, norm_before_residual=False, torch_dtype="float32",
    )  # fmt: skip
    model = PEagleDraftModel(config).eval()
    run = make_run(tmp_path / "run", str(small_verifier_dir), {5: model}, best_step=5, speculative_tokens=3)
    with pytest.warns(ExportWarning, match=r"not ascending.*'mask_hidden'"):
        export_checkpoint(run, tmp_path / "exported", dtype="float32")
    with pytest.warns(ExportWarning, match=r"not ascending.*'mask_hidden'"):
        convert_checkpoint(run / "checkpoints" / "step-5" / "draft", tmp_path / "converted", dtype="float32")
    gen = torch.Generator().manual_seed(2)
    ids, positions = torch.randint(0, 1000, (1, 4), generator=gen), torch.arange(4)[None]
    trained = {layer: torch.randn(1, 4, 64, generator=gen) for layer in (6, 1, 4)}

    def mask_slot_logits(draft: PEagleDraftModel, order: tuple[int, ...]) -> torch.Tensor:
        """Slot 0 reads the aux states (in ``order``), slots 1..3 the mask token and fc(mask_hidden)."""
        real = draft.project_features(torch.cat([trained[i] for i in order], -1))
        mask_ids, mask_features = draft.mask_slots((1, 3), real)
        tokens = torch.cat([ids[:, :1], mask_ids], 1)
        with torch.no_grad():
            return draft(tokens, torch.cat([real[:, :1], mask_features], 1), positions)[0]

    as_trained = mask_slot_logits(model, (6, 1, 4))
    for out in ("exported", "converted"):
        served = PEagleDraftModel.from_pretrained(tmp_path / out)
        assert served.config.eagle_aux_hidden_state_layer_ids == [1, 4, 6]
        torch.testing.assert_close(mask_slot_logits(served, (1, 4, 6)), as_trained, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the control: fc permuted but mask_hidden left as trained (the bug)
        served.mask_hidden.copy_(model.mask_hidden)
    assert (mask_slot_logits(served, (1, 4, 6)) - as_trained)[:, 1:].abs().max() > 0.1


def test_a_peagle_source_without_mask_token_is_refused(tmp_path, small_verifier_dir):
    """speculators 0.9.0 writes ``mask_token_id: null`` when its trainer was given none to resolve: vLLM cannot fill
    the mask slots, so nothing is written and the error says which key."""
    from speculators.algorithms.peagle.config import PEagleConfig
    from speculators.algorithms.peagle.model import PEagleDraftModel

    config = PEagleConfig.from_verifier(
        read_config(small_verifier_dir), str(small_verifier_dir), mask_token_id=3, draft_vocab_size=1000
    )
    PEagleDraftModel(config).save_pretrained(tmp_path / "src", dtype=torch.float32)
    stored = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps({**stored, "mask_token_id": None}))
    with pytest.raises(InvalidCheckpointError, match="mask_token_id None must be an integer"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_repeated_aux_ids_are_refused(tmp_path, small_verifier_dir):
    """vLLM de-duplicates aux ids, so fc would be too narrow: the converter warns and the validator refuses."""
    model = build_draft(small_verifier_dir, draft_vocab_size=256, aux_layer_ids=[2, 3, 3])
    model.save_pretrained(tmp_path / "src")
    with (
        pytest.warns(ExportWarning, match="vLLM fails to run this draft"),
        pytest.raises(InvalidCheckpointError, match="repeated or unsorted"),
    ):
        convert_checkpoint(tmp_path / "src", tmp_path / "out")
    assert not (tmp_path / "out").exists()
