"""Issue 40 in data_gen: nothing lost, nothing silent. A conversation the chat template refuses is dropped and
counted, not the run; every user mistake (a missing template file, the wrong ``data.format``, non-UTF-8 bytes, an
empty file, a manifest that disagrees with its shard, a held-out fraction that takes everything, an output
directory under a file) is said in one message naming the file, the record and the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data_gen.masks import ChatMasker, TemplateError
from data_gen.pipeline import format_summary, run_data_gen
from data_gen.sources import DataSettings, SourceError, load_conversations
from data_gen.store import CorruptShardError, FeatureDataset, finalize_split, record_name, write_shard
from tests.conftest import REPO_ROOT
from tests.data_gen.conftest import chat_records, write_jsonl
from tests.data_gen.test_store import NUM_AUX, samples

# SmolLM2's ChatML, made strict as Gemma 3's, Llama-2's and Mistral's templates are: roles must alternate.
STRICT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
TWO_USERS = {
    "id": "two-users",
    "conversations": [
        {"from": "human", "value": "First question."},
        {"from": "human", "value": "Second question."},
        {"from": "gpt", "value": "One answer to both."},
    ],
}


def make_config(verifier_dir, source, out, **data) -> dict:
    return {
        "verifier": {"name_or_path": str(verifier_dir), "dtype": "float32", "aux_layer_ids": None},
        "data": {"source": str(source), "heldout_fraction": 0.2, "max_length": 96, "seed": 0, **data},
        "data_gen": {"output_dir": str(out), "batch_size": 4, "shard_size": 4, "storage_dtype": "bfloat16"},
    }


def settings(source, **overrides) -> DataSettings:
    return DataSettings.from_mapping({"source": str(source), **overrides})


@pytest.fixture
def strict_template(tmp_path) -> Path:
    path = tmp_path / "strict.jinja"
    path.write_text(STRICT_TEMPLATE)
    return path


# ---- 1. a conversation the chat template refuses ---------------------------------------------------------
def test_a_conversation_the_template_refuses_is_dropped_and_counted(
    tiny_llama_dir, strict_template, tmp_path
):
    records = chat_records(7)
    source = write_jsonl(tmp_path / "chats.jsonl", records[:3] + [TWO_USERS] + records[3:])
    out = tmp_path / "data"
    summary = run_data_gen(make_config(tiny_llama_dir, source, out, chat_template=str(strict_template)))
    assert summary["counts"]["dropped_template_error"] == 1
    produced = FeatureDataset(out / "train").sample_ids + FeatureDataset(out / "heldout").sample_ids
    assert sorted(produced) == sorted(r["id"] for r in records)  # every other conversation, once
    [example] = summary["drop_examples"]["template_error"]
    assert "'two-users'" in example and "Conversation roles must alternate" in example
    assert json.loads((out / "summary.json").read_text())["drop_examples"] == summary["drop_examples"]
    printed = format_summary(summary)
    assert "dropped_template_error': 1" in printed and "Conversation roles must alternate" in printed


def test_regeneration_leaves_a_refused_conversation_to_be_dropped(tiny_llama_dir, strict_template, tmp_path):
    """With regeneration on, the refused prompt does not stop the run either: the conversation is dropped once."""
    source = write_jsonl(tmp_path / "chats.jsonl", [TWO_USERS, *chat_records(3)])
    config = make_config(tiny_llama_dir, source, tmp_path / "data", chat_template=str(strict_template))
    config["data_gen"]["regenerate"] = {"enabled": True, "backend": "transformers", "max_new_tokens": 3}
    summary = run_data_gen(config)
    assert summary["counts"]["dropped_template_error"] == 1
    assert sum(summary["samples"].values()) == 3


def test_a_template_refusing_every_training_conversation_says_why(tiny_llama_dir, strict_template, tmp_path):
    """Not "nothing encodes within data.max_length": the reasons the conversations were dropped."""
    records = [{**TWO_USERS, "id": f"two-users-{i}"} for i in range(4)]
    source = write_jsonl(tmp_path / "chats.jsonl", records)
    config = make_config(
        tiny_llama_dir, source, tmp_path / "data", chat_template=str(strict_template), heldout_fraction=0.0
    )
    with pytest.raises(
        ValueError,
        match=r"could be masked \(dropped: template_error=4; e.g. conversation 'two-users-0': .*alternate",
    ):
        run_data_gen(config)


def test_a_template_that_fails_on_every_conversation_is_refused_as_a_template(smollm2_tokenizer):
    with pytest.raises(
        TemplateError, match="cannot render a plain two-turn conversation.*data.chat_template"
    ):
        ChatMasker(smollm2_tokenizer, chat_template="{% for message in messages %}{{ message.content }")


# ---- 2. misleading errors made clear -----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["chatml.jinja", "templates/chatml", "chatml.j2", "chatml.txt"])
def test_a_missing_chat_template_file_is_named(smollm2_tokenizer, tmp_path, name):
    missing = tmp_path / name
    with pytest.raises(
        TemplateError, match=f"{missing} does not exist; give an existing Jinja template file"
    ):
        ChatMasker(smollm2_tokenizer, chat_template=str(missing))
    with pytest.raises(TemplateError, match=f"{tmp_path} is a directory"):
        ChatMasker(smollm2_tokenizer, chat_template=str(tmp_path))


def test_a_chat_template_given_as_text_or_file_still_works(smollm2_tokenizer, tmp_path):
    template = smollm2_tokenizer.chat_template
    path = tmp_path / "chatml.jinja"
    path.write_text(template)
    assert ChatMasker(smollm2_tokenizer, chat_template=str(path)).template == template
    assert ChatMasker(smollm2_tokenizer, chat_template=template).template == template


OPENAI = [
    {"id": f"o{i}", "messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}
    for i in range(3)
]


@pytest.mark.parametrize(
    ("records", "forced", "found"),
    [(OPENAI, "sharegpt", "openai"), (chat_records(3), "openai", "sharegpt")],
)
def test_the_wrong_data_format_names_the_right_one(tmp_path, records, forced, found):
    path = write_jsonl(tmp_path / "d.jsonl", records)
    hint = f"looks like the {found} layout: set data.format={found}"
    with pytest.raises(SourceError, match=f"no usable conversation.*format_mismatch=3.*{hint}"):
        load_conversations(settings(path, format=forced))
    with pytest.raises(SourceError, match=rf"d.jsonl record #0 \(id '\w+'\): data.format={forced} .*{hint}"):
        load_conversations(settings(path, format=forced, on_invalid="error"))


@pytest.fixture
def latin1_jsonl(tmp_path) -> Path:
    """Four conversations, the third one's line written in Latin-1 (``é`` as the lone byte 0xe9)."""
    lines = [json.dumps(record).encode() for record in chat_records(3)]
    bad = {
        "id": "latin",
        "conversations": [{"from": "human", "value": "café?"}, {"from": "gpt", "value": "Oui."}],
    }
    lines.insert(2, json.dumps(bad, ensure_ascii=False).encode("latin-1"))
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_a_non_utf8_line_is_dropped_and_counted(latin1_jsonl):
    conversations, report = load_conversations(settings(latin1_jsonl))
    assert [c.id for c in conversations] == ["c000", "c001", "c002"]
    assert report.dropped == {"not_utf8": 1} and report.records == 4


def test_a_non_utf8_line_is_named_with_on_invalid_error(latin1_jsonl, tmp_path):
    message = r"latin.jsonl record #2: line 3 is not UTF-8 text \(byte 0xe9.*re-encode the file as UTF-8"
    with pytest.raises(SourceError, match=message):
        load_conversations(settings(latin1_jsonl, on_invalid="error"))
    array = tmp_path / "latin.json"  # one JSON array: no record can be dropped from it, the line is named
    array.write_bytes(b"[" + b",\n".join(latin1_jsonl.read_bytes().splitlines()) + b"]")
    with pytest.raises(SourceError, match=r"latin.json line 3 is not UTF-8 text.*re-encode"):
        load_conversations(settings(array))


@pytest.mark.parametrize("name,text", [("empty.jsonl", ""), ("empty.json", ""), ("blank.jsonl", "\n \n")])
def test_an_empty_data_file_is_called_empty(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(SourceError, match=f"{path} is empty; give data.source a file with conversations"):
        load_conversations(settings(path))


@pytest.fixture
def split_dir(tmp_path) -> Path:
    directory = tmp_path / "data" / "train"
    for index in range(2):
        write_shard(directory, index, samples(2, seed=index), NUM_AUX, "bfloat16")
    finalize_split(directory, 2, {"aux_layer_ids": [2, 3, 4], "hidden_size": 32})
    return directory


def edit_manifest_sha(split_dir: Path, index: int) -> None:
    manifest = json.loads((split_dir / "manifest.json").read_text())
    manifest["shards"][index]["sha256"] = "0" * 64
    (split_dir / "manifest.json").write_text(json.dumps(manifest))


def test_a_wrong_hash_in_the_manifest_blames_the_manifest_not_the_shard(split_dir):
    edit_manifest_sha(split_dir, 1)
    dataset = FeatureDataset(split_dir)
    dataset[0]
    with pytest.raises(CorruptShardError) as caught:
        dataset[2]
    message = str(caught.value)
    assert "is corrupted" not in message
    assert str(split_dir / "manifest.json") in message and str(split_dir / record_name(1)) in message
    assert "the manifest is the odd one out" in message and "the shard is intact" in message
    assert "rerun data_gen with the same recipe" in message.lower()


def test_a_disagreement_no_record_can_settle_names_both_files(split_dir):
    edit_manifest_sha(split_dir, 1)
    (split_dir / record_name(1)).unlink()
    with pytest.raises(CorruptShardError) as caught:
        FeatureDataset(split_dir)[2]
    message = str(caught.value)
    assert "is corrupted" not in message
    assert f"{split_dir / 'shard-00001.safetensors'} and {split_dir / 'manifest.json'} disagree" in message
    assert "is missing" in message and "rerun data_gen" in message


def test_holding_out_every_conversation_names_the_held_out_setting(tiny_llama_dir, tmp_path):
    source = write_jsonl(tmp_path / "chats.jsonl", chat_records(2))
    config = make_config(tiny_llama_dir, source, tmp_path / "data", heldout_fraction=0.99)
    with pytest.raises(SourceError, match=r"data.heldout_fraction=0.99 held out all 2 conversations.*lower"):
        run_data_gen(config)
    assert not (tmp_path / "data").exists()


# ---- 3. the entry point: one `error:` line for every user error -----------------------------------------
def run_data_gen_script(tmp_path: Path, overrides: list[str], **env: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(REPO_ROOT / "data_gen" / "run.py"), "recipe=tiny_eagle3", *overrides]
    argv += [f"run_dir={tmp_path}/run", f"hydra.run.dir={tmp_path}/hydra"]
    environment = {**os.environ, **env}
    return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=environment)


def test_an_os_error_inside_the_run_ends_in_one_error_line(tiny_llama_dir, tmp_path):
    """An output directory under a regular file (an OSError, not a FileNotFoundError): one line naming the file
    and the setting, exit 1; SPECULATORS_TRACEBACK=1 still shows the traceback."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where a directory belongs")
    source = write_jsonl(tmp_path / "chats.jsonl", chat_records(6))
    overrides = [
        f"verifier.name_or_path={tiny_llama_dir}",
        f"data.source={source}",
        f"data_gen.output_dir={blocker}/data",
    ]
    result = run_data_gen_script(tmp_path, overrides)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(blocker) in errors[0] and "data_gen.output_dir" in errors[0]
    verbose = run_data_gen_script(tmp_path, overrides, SPECULATORS_TRACEBACK="1")
    assert verbose.returncode != 0 and "NotADirectoryError" in verbose.stderr
