"""Training targets are the verifier's own distribution, whatever its family, declared or not.

A verifier whose final norm multiplies by ``1 + w`` (Gemma 1-3) was once read Llama-style (``x·w``) when no family
module declared it: its targets agreed with the verifier's argmax 18 % of the time and nothing warned. Here a tiny
Gemma (model_type ``gemma``, declared by no module) and a tiny Gemma 3 (declared) go through data generation and
training; the trainer's head must equal the verifier's own logits, the start-up check must pass on both, and the
same check must stop a head that reads the norm Llama-style, and a run whose recorded logits are not its head's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from speculators import families
from speculators.head_check import PROBE_NAME, HeadMismatchError, HeadProbe, record_head_probe
from tests.support.families import CONVERSATIONS, build_family_verifier, family_tokenizer
from train.targets import TargetHead

pytestmark = pytest.mark.filterwarnings("ignore::speculators.export.ExportWarning")


def sharpen_final_norm(directory: Path, model_type: str) -> Path:
    """Give the final norm weights far from 0 and 1 and a peaked lm_head, so ``x·w`` and ``x·(1 + w)`` disagree
    on the argmax (a fresh Gemma norm holds zeros, which would make the wrong reading trivially flat)."""
    from speculators.verifier import load_verifier

    model, _ = load_verifier(str(directory), "float32")
    generator = torch.Generator().manual_seed(1)
    norm = families.of_model(model).final_norm(model)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(norm.weight.shape, generator=generator) * 0.8)
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(directory)
    return directory


def undeclared_gemma(directory: Path) -> Path:
    """A tiny Gemma 1 (model_type ``gemma``: final norm ``1 + w``, scaled embedding), which no module declares,
    with a Gemma chat template."""
    from transformers import GemmaConfig, GemmaForCausalLM

    tokenizer = family_tokenizer("gemma3_text")
    config = GemmaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        initializer_range=0.3,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    GemmaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", params=["gemma", "gemma3_text"])
def verifier(request, tmp_path_factory) -> tuple[str, Path]:
    root = tmp_path_factory.mktemp(f"head-{request.param}")
    if request.param == "gemma":
        directory = undeclared_gemma(root / "verifier")
    else:
        directory = build_family_verifier(root / "verifier", request.param)
    return request.param, sharpen_final_norm(directory, request.param)


def verifier_logits(directory: Path, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The verifier's own logits and its pre-norm last states on ``ids``."""
    from data_gen.capture import FeatureCapture
    from speculators.verifier import load_verifier

    model, _ = load_verifier(str(directory), "float32")
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    last = FeatureCapture(model).capture(ids)["last_hidden"]
    return logits, last


def test_the_declaration_is_what_it_should_be(verifier):
    name, directory = verifier
    config = json.loads((directory / "config.json").read_text())
    assert families.of_config(config).declared is (name == "gemma3_text")
    note = families.vllm_serving_note(config)
    if name == "gemma":
        assert "unverified" in note and "'gemma'" in note
    else:
        assert "will not serve" in note and families.get(name).vllm_refusal in note
    assert families.vllm_serving_note({"model_type": "llama"}) is None


def test_targets_are_the_verifiers_logits_read_from_its_files(verifier):
    _, directory = verifier
    config = json.loads((directory / "config.json").read_text())
    ids = torch.tensor([[5, 17, 99, 3, 250, 41, 7, 300, 12, 64]])
    logits, last = verifier_logits(directory, ids)
    vocab = torch.arange(int(config["vocab_size"]))
    head = TargetHead.from_verifier_files(str(directory), config, vocab)
    torch.testing.assert_close(head.draft_logits(last), logits, rtol=1e-4, atol=1e-4)
    # the Llama reading of the same norm weight (x·w) is far off: what the head used to compute here
    wrong = llama_read_head(head)
    assert (wrong.draft_logits(last).argmax(-1) == logits.argmax(-1)).float().mean() < 0.6


def llama_read_head(head: TargetHead) -> TargetHead:
    """The head with its final norm re-implemented as a Llama RMSNorm on the same weight: the offset forgotten."""
    weight = head.norm.weight.detach()
    eps = float(getattr(head.norm, "eps", getattr(head.norm, "variance_epsilon", 1e-6)))
    return TargetHead.with_rms_norm(weight, head.weight, eps, head.target_ids)


def test_the_start_up_check_catches_a_wrong_norm_offset(verifier):
    _, directory = verifier
    from speculators.verifier import load_verifier

    config = json.loads((directory / "config.json").read_text())
    model, tokenizer = load_verifier(str(directory), "float32")
    ids = tokenizer.apply_chat_template(CONVERSATIONS[0], tokenize=True, return_dict=True)["input_ids"]
    probe = record_head_probe(model, ids)
    head = TargetHead.from_verifier_files(str(directory), config, torch.arange(int(config["vocab_size"])))
    agreement = head.check(probe, str(directory), "the test's probe")
    assert agreement.argmax_agreement == 1.0 and agreement.logprob_error < 1e-3
    with pytest.raises(HeadMismatchError, match="does not reproduce") as caught:
        llama_read_head(head).check(probe, str(directory), "the test's probe")
    assert "\n" not in str(caught.value)


def test_data_gen_and_training_check_the_head(verifier, tmp_path, capsys):
    """The real pipeline: data_gen records the probe, the trainer checks its head before the first step and trains;
    the same data with another verifier's recorded logits stops the trainer before any step."""
    from data_gen.pipeline import run_data_gen
    from tests.train.conftest import compose
    from train.trainer import train

    name, directory = verifier
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        "".join(json.dumps({"id": f"c{i}", "messages": c}) + "\n" for i, c in enumerate(CONVERSATIONS))
    )
    data_dir, run_dir = tmp_path / "data", tmp_path / "run"
    overrides = [
        "recipe=tiny_eagle3",
        f"verifier.name_or_path={directory}",
        f"data.source={chats}",
        "data.heldout_fraction=0.25",
        "data.max_length=256",
        "train.max_length=256",
        "train.max_steps=2",
        "train.micro_batch_size=2",
        "model.draft_vocab_size=null",
        "logging=disabled",
        f"run_dir={run_dir}",
        f"data_gen.output_dir={data_dir}",
        f"train.data_dir={data_dir}",
    ]
    cfg = compose(overrides)
    run_data_gen(OmegaConf.to_container(cfg, resolve=True))
    probe = HeadProbe.load(data_dir / PROBE_NAME)
    assert probe is not None and probe.top_ids.shape[1] == 32
    result = train(cfg, run_dir)
    assert result["step"] == 2
    out = capsys.readouterr().out
    assert "head check: the training head reproduces the verifier's logits (argmax agreement" in out
    if name == "gemma":
        assert "vLLM serving is unverified for model_type 'gemma'" in out
    else:  # a declared refusal: eval --vllm says so in one line and keeps our engine's measurements
        from speculators.eval.evaluation import EvalSettings, evaluate
        from speculators.export import export_checkpoint

        export_checkpoint(run_dir, tmp_path / "export", dtype="float32")
        card = (tmp_path / "export" / "README.md").read_text()
        assert "vLLM does not serve it" in card and "vLLM serves it as it is" not in card
        assert "vllm serve" not in card
        settings = EvalSettings(ks=[2], max_new_tokens=4, max_prompts=1, vllm=True)
        results = evaluate(tmp_path / "export", str(directory), chats, settings, tmp_path / "eval")
        assert results["vllm"] == {
            "skipped": families.vllm_serving_note(json.loads((directory / "config.json").read_text()))
        }
        assert json.loads((tmp_path / "eval" / "results.json").read_text())["runs"]
        assert "will not serve a draft for this Gemma 3 verifier" in capsys.readouterr().out

    # another verifier's logits recorded beside the same features: the head no longer reproduces them
    shuffled = HeadProbe(probe.last_prenorm, probe.top_ids.roll(1, dims=-1), probe.top_logprobs)
    shuffled.save(data_dir / PROBE_NAME)
    with pytest.raises(HeadMismatchError, match=str(data_dir / PROBE_NAME)):
        train(compose([*overrides, f"run_dir={tmp_path / 'run2'}"]), tmp_path / "run2")
