"""The whole data_gen run on a tiny verifier: the trainer's contract, resume after a crash, refusals, regeneration."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from data_gen.capture import FeatureCapture
from data_gen.masks import ChatMasker, TemplateError
from data_gen.pipeline import run_data_gen
from data_gen.sources import Conversation, SourceError
from data_gen.store import FeatureDataset, IncompatibleOutputError, read_manifest, read_token_counts
from speculators.vocab import build_draft_vocab, tokenizer_fingerprint
from tests.conftest import require_consumer
from tests.data_gen.conftest import chat_records, write_jsonl


def make_config(verifier_dir, source, out, **overrides) -> dict:
    config = {
        "verifier": {"name_or_path": str(verifier_dir), "dtype": "float32", "aux_layer_ids": None},
        "data": {"source": str(source), "heldout_fraction": 0.2, "max_length": 96, "seed": 0},
        "data_gen": {"output_dir": str(out), "batch_size": 3, "shard_size": 4, "storage_dtype": "bfloat16"},
    }
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        config[section][key] = value
    return config


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("chats") / "chats.jsonl", chat_records(18, turns=3))


@pytest.fixture(scope="module")
def finished(tiny_llama_dir, chats, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "data"
    summary = run_data_gen(make_config(tiny_llama_dir, chats, out))
    return out, summary


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()
    }


def test_output_follows_the_trainer_contract(finished, tiny_llama_dir, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM

    out, summary = finished
    train, heldout = FeatureDataset(out / "train"), FeatureDataset(out / "heldout")
    assert len(train) + len(heldout) == 18 and len(heldout) >= 1
    assert summary["samples"] == {"train": len(train), "heldout": len(heldout)}
    assert not set(train.sample_ids) & set(heldout.sample_ids)
    held = [json.loads(line) for line in (out / "heldout_conversations.jsonl").read_text().splitlines()]
    assert [h["id"] for h in held] == heldout.sample_ids
    assert all(m["role"] in ("user", "assistant") for h in held for m in h["messages"])

    manifest = train.manifest
    assert manifest["aux_layer_ids"] == [2, 4, 5] and manifest["num_hidden_layers"] == 8
    assert manifest["layer_convention"] == "vllm: residual stream entering layer k"
    assert (manifest["hidden_size"], manifest["vocab_size"]) == (64, len(smollm2_tokenizer))
    assert manifest["tokenizer"]["fingerprint"] == tokenizer_fingerprint(smollm2_tokenizer)
    assert manifest["tokenizer"]["eot_token"] == "<|im_end|>"
    assert all(len(s["sha256"]) == 64 for s in manifest["shards"])

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    capture, masker = FeatureCapture(model), ChatMasker(smollm2_tokenizer)
    records = {r["id"]: r for r in chat_records(18, turns=3)}
    for index in (0, len(train) - 1):
        item = train[index]
        turns = records[item["sample_id"]]["conversations"]
        messages = [
            {"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]} for t in turns
        ]
        [expected] = masker.encode(Conversation(item["sample_id"], messages), max_length=96)
        assert item["input_ids"].tolist() == expected.input_ids
        assert item["loss_mask"].tolist() == [bool(b) for b in expected.loss_mask]
        alone = capture.capture(item["input_ids"][None])  # unpadded, fp32: the stored bf16 must match it
        for key in ("aux_hidden", "last_hidden"):
            assert item[key].shape == alone[key][0].shape
            torch.testing.assert_close(item[key], alone[key][0], rtol=1e-2, atol=1e-2)

    counts, provenance = read_token_counts(out)
    expected_counts = torch.zeros(len(smollm2_tokenizer), dtype=torch.long)
    for item in train:
        expected_counts += torch.bincount(
            item["input_ids"][item["loss_mask"]], minlength=len(expected_counts)
        )
    assert torch.equal(counts, expected_counts) and int(counts.sum()) == manifest["num_loss_tokens"]
    assert provenance["tokenizer_fingerprint"] == tokenizer_fingerprint(smollm2_tokenizer)
    vocab = build_draft_vocab(counts, 64, provenance)
    assert bool(vocab.t2d[smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")])  # every answer ends with it


def test_resume_after_a_crash_gives_the_same_bytes(finished, tiny_llama_dir, chats, tmp_path):
    reference, _ = finished
    out = tmp_path / "data"
    config = make_config(tiny_llama_dir, chats, out)
    written = []

    def crash_after_two(split, index, record):
        written.append((split, index))
        if len(written) == 2:
            raise KeyboardInterrupt("simulated kill")

    with pytest.raises(KeyboardInterrupt):
        run_data_gen(config, on_shard=crash_after_two)
    assert not (out / "train" / "manifest.json").exists()
    # what a kill in the middle of the next write leaves: a temporary and a shard without its record
    (out / "train" / ".shard-00002.safetensors.tmp-dead").write_bytes(b"half")
    (out / "train" / ".tmpAbC123").write_bytes(b"half")  # safetensors >= 0.8 writes its own temporary first
    (out / "train" / "shard-00002.safetensors").write_bytes(b"not a finished shard")
    resumed = []
    run_data_gen(config, on_shard=lambda split, index, record: resumed.append((split, index)))
    total = sum(read_manifest(reference / split)["num_shards"] for split in ("train", "heldout"))
    assert not set(resumed) & set(written) and len(written) + len(resumed) == total
    assert not list(out.rglob(".*tmp-*")) and not list(out.rglob(".tmp*"))
    ours, theirs = snapshot(out), snapshot(reference)
    for name in theirs:
        if name.startswith(("train/", "heldout/")) or name in (
            "token_counts.safetensors",
            "heldout_conversations.jsonl",
        ):
            if name.endswith("manifest.json"):
                strip = lambda m: {k: v for k, v in json.loads(m).items() if k != "verifier"}  # noqa: E731
                assert strip(ours[name]) == strip(theirs[name])
            else:
                assert ours[name] == theirs[name], name


def test_rerun_of_a_finished_output_does_no_work(finished, tiny_llama_dir, chats):
    out, summary = finished
    before = snapshot(out / "train")
    calls = []
    again = run_data_gen(make_config(tiny_llama_dir, chats, out), on_shard=lambda *a: calls.append(a))
    assert calls == [] and again["samples"] == summary["samples"] and again["tokens_captured_now"] == 0
    assert snapshot(out / "train") == before


def test_output_dir_of_another_verifier_is_refused(finished, tiny_qwen3_dir, chats):
    out, _ = finished
    before = snapshot(out)
    with pytest.raises(IncompatibleOutputError, match="verifier.fingerprint.*another data_gen.output_dir"):
        run_data_gen(make_config(tiny_qwen3_dir, chats, out))
    assert snapshot(out) == before


def test_changed_settings_on_the_same_output_dir_are_refused(finished, tiny_llama_dir, chats):
    out, _ = finished
    with pytest.raises(IncompatibleOutputError, match="data.max_length: stored 96 vs now 64"):
        run_data_gen(make_config(tiny_llama_dir, chats, out, data__max_length=64))


def test_bad_inputs_are_refused_before_anything_is_written(
    tiny_llama_dir, chats, smollm2_tokenizer, tmp_path
):
    from tests.support.verifiers import build_tiny_verifier

    out = tmp_path / "data"
    with pytest.raises(ValueError, match=r"aux layer ids \[9\] are outside \[0, 8\]"):
        run_data_gen(make_config(tiny_llama_dir, chats, out, verifier__aux_layer_ids=[2, 3, 9]))
    broken = tmp_path / "broken.jsonl"
    broken.write_text(chats.read_text() + '{"id": "x", "conversations": [{"from": "human"\n')
    with pytest.raises(SourceError, match="broken.jsonl line 19: not valid JSON"):
        run_data_gen(make_config(tiny_llama_dir, broken, out))
    unknown = write_jsonl(
        tmp_path / "roles.jsonl",
        chat_records(3)
        + [
            {
                "id": "r",
                "conversations": [{"from": "human", "value": "Q"}, {"from": "narrator", "value": "A"}],
            }
        ],
    )
    with pytest.raises(SourceError, match=r"record #3 \(id 'r'\): unknown role 'narrator'"):
        run_data_gen(make_config(tiny_llama_dir, unknown, out, data__on_invalid="error"))
    no_answer = write_jsonl(
        tmp_path / "noanswer.jsonl", [{"id": "q", "conversations": [{"from": "human", "value": "Q"}]}]
    )
    with pytest.raises(SourceError, match="no usable conversation.*no_assistant_turn=1"):
        run_data_gen(make_config(tiny_llama_dir, no_answer, out))
    plain = copy.deepcopy(smollm2_tokenizer)
    plain.chat_template = None
    base = build_tiny_verifier(tmp_path / "base-model", tokenizer=plain, vocab_size=len(plain))
    (base / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(TemplateError, match="no chat template"):
        run_data_gen(make_config(base, chats, out))
    assert not out.exists()


def test_regeneration_is_turn_by_turn_and_resumable(tiny_llama_dir, chats, smollm2_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "data"
    regen = {
        "enabled": True,
        "backend": "transformers",
        "temperature": 0.0,
        "max_new_tokens": 6,
        "batch_size": 3,
    }
    config = make_config(tiny_llama_dir, chats, out, data__max_conversations=6, data_gen__regenerate=regen)
    run_data_gen(config)
    caches = sorted((out / "regenerated").rglob("shard-*.jsonl"))
    entries = [json.loads(line) for cache in caches for line in cache.read_text().splitlines()]
    assert len(entries) == 6
    originals = {r["id"]: r["conversations"] for r in chat_records(18, turns=3)}
    multi = next(e for e in entries if e["messages"] and len(e["messages"]) >= 4)
    original = originals[multi["id"]]
    assert [m["content"] for m in multi["messages"][::2]] == [t["value"] for t in original[::2]][
        : len(multi["messages"][::2])
    ]
    assert multi["messages"][1]["content"] != original[1]["value"]
    # turn 2 was generated from a history that holds the regenerated turn 1
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    masker = ChatMasker(smollm2_tokenizer)
    prompt = masker.tokenize(masker.prompt_text(multi["messages"][:3]))[0]
    generated = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=6,
        do_sample=False,
        eos_token_id=[masker.eot_id],
        pad_token_id=masker.eot_id,
    )
    text = smollm2_tokenizer.decode(generated[0, len(prompt) :], skip_special_tokens=True).strip()
    assert multi["messages"][3]["content"] == text
    train = FeatureDataset(out / "train")
    assert train.manifest["regenerate"] == {"enabled": True, "temperature": 0.0, "max_new_tokens": 6}
    # resume: drop the feature shards but keep the regeneration cache -> no new generation, same features
    before = {p.name: p.read_bytes() for p in caches}
    first = train[0]
    for path in (out / "train").glob("shard-*"):
        path.unlink()
    run_data_gen(config)
    assert {p.name: p.read_bytes() for p in caches} == before
    torch.testing.assert_close(FeatureDataset(out / "train")[0]["aux_hidden"], first["aux_hidden"])


def test_answers_cut_at_max_new_tokens_stay_cut(tiny_llama_dir, chats, smollm2_tokenizer, tmp_path):
    """A random verifier never ends its answer within 4 tokens: every regenerated answer is cut, marked so in the
    cache, counted in the stats, and no end-of-turn token the verifier never emitted is in the loss."""
    out = tmp_path / "data"
    regen = {"enabled": True, "backend": "transformers", "max_new_tokens": 4, "batch_size": 4}
    summary = run_data_gen(
        make_config(tiny_llama_dir, chats, out, data__max_conversations=5, data_gen__regenerate=regen)
    )
    entries = [
        json.loads(line)
        for cache in sorted((out / "regenerated").rglob("shard-*.jsonl"))
        for line in cache.read_text().splitlines()
    ]
    answers = [m for e in entries for m in e["messages"] or [] if m["role"] == "assistant"]
    assert answers and all(m.get("truncated") is True for m in answers)
    assert summary["counts"]["regenerate_answers_cut_at_max_new_tokens"] == len(answers)
    eot = ChatMasker(smollm2_tokenizer).eot_id
    for split in ("train", "heldout"):
        dataset = FeatureDataset(out / split)
        for index in range(len(dataset)):
            sample = dataset[index]
            assert sample["loss_mask"].any()  # the cut answers still teach their content
            assert eot not in sample["input_ids"][sample["loss_mask"]].tolist(), sample["sample_id"]
            assert eot in sample["input_ids"].tolist()  # the template still closes the turn in the context


def test_transformers_backend_tells_a_cut_answer_from_a_finished_one(tiny_llama_dir, smollm2_tokenizer):
    """The answer that generates a stop id is finished; the one that runs into max_new_tokens is cut."""
    from transformers import AutoModelForCausalLM

    from data_gen.regenerate import RegenerateSettings, transformers_generate

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prompts = [[10, 11, 12, 13], [200, 201, 202, 203]]  # equal lengths: no padding, same numbers as alone
    greedy = [
        model.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False, eos_token_id=None)[
            0, 4:
        ].tolist()
        for p in prompts
    ]
    stop = greedy[0][1]  # the first answer stops at its second token; the second never generates it
    assert stop != greedy[0][0] and stop not in greedy[1], greedy
    generate = transformers_generate(
        model, smollm2_tokenizer, RegenerateSettings(max_new_tokens=4), stop_ids=[stop]
    )
    finished, cut = generate(prompts, seed=0)
    assert not finished.truncated and cut.truncated
    assert cut.text == smollm2_tokenizer.decode(greedy[1], skip_special_tokens=True)


def test_vllm_backend_without_its_virtualenv_says_so(tiny_llama_dir, chats, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULATORS_VLLM_PYTHON", str(tmp_path / "no-such-venv" / "python"))
    regen = {"enabled": True, "backend": "vllm"}
    out = tmp_path / "data"
    with pytest.raises(
        RuntimeError, match="backend=vllm is not available.*make vllm-env.*backend=transformers"
    ):
        run_data_gen(make_config(tiny_llama_dir, chats, out, data_gen__regenerate=regen))
    assert not out.exists()


def test_recipe_groups_compose_with_hydra():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from data_gen.pipeline import GenSettings
    from data_gen.sources import DataSettings

    recipes = Path(__file__).resolve().parents[2] / "recipes"
    with initialize_config_dir(config_dir=str(recipes), version_base=None):
        cfg = compose(config_name="config", overrides=["recipe=eagle3_smollm2"])
    config = OmegaConf.to_container(cfg, resolve=True)
    data, gen = DataSettings.from_mapping(config["data"]), GenSettings.from_mapping(config["data_gen"])
    assert data.source == "sharegpt_builtin" and gen.output_dir == "outputs/eagle3_smollm2/data"
    assert gen.storage_dtype == "bfloat16" and not gen.regenerate.enabled


@pytest.mark.consumer
@pytest.mark.slow  # one vLLM engine start in its own virtualenv: ~30-60 s on 2 shared cores
def test_vllm_regeneration_matches_transformers_greedy(smollm2_dir, tmp_path):
    from speculators.serving.vllm_bridge import vllm_available

    require_consumer(vllm_available(), "the vLLM virtualenv", "vllm-env")
    source = write_jsonl(
        tmp_path / "qa.jsonl",
        [
            {
                "id": "fr",
                "messages": [
                    {"role": "user", "content": "What is the capital of France?"},
                    {"role": "assistant", "content": "I do not know."},
                ],
            },
        ],
    )
    answers = {}
    for backend in ("vllm", "transformers"):
        regen = {
            "enabled": True,
            "backend": backend,
            "temperature": 0.0,
            "max_new_tokens": 16,
            "batch_size": 4,
        }
        out = tmp_path / backend
        config = make_config(smollm2_dir, source, out, data__heldout_fraction=0.0, data_gen__regenerate=regen)
        run_data_gen(config)
        [entry] = [json.loads(line) for line in (out / "regenerated" / "train" / "shard-00000.jsonl").open()]
        answers[backend] = (entry["messages"][1]["content"], entry["messages"][1].get("truncated", False))
    assert "Paris" in answers["vllm"][0]
    assert (
        answers["vllm"] == answers["transformers"]
    )  # fp32 greedy, one prompt; both say whether 16 tokens cut it
