"""Sources: every layout and file type, role normalisation, counted drops, clear errors, a stable split."""

from __future__ import annotations

import json

import pytest

from data_gen.sources import (
    DataSettings,
    SourceError,
    heldout_score,
    load_conversations,
    split_conversations,
)
from tests.data_gen.conftest import chat_records, write_jsonl

EXPECTED = [
    {"role": "system", "content": "Be kind."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
]


def settings(source, **overrides) -> DataSettings:
    return DataSettings.from_mapping({"source": str(source), **overrides})


def test_three_layouts_normalise_to_the_same_messages(tmp_path):
    records = [
        {
            "id": "a",
            "conversations": [
                {"from": "system", "value": "Be kind."},
                {"from": "human", "value": "Hi"},
                {"from": "gpt", "value": "Hello!"},
            ],
        },
        {
            "id": "b",
            "messages": [
                {"role": "system", "content": "Be kind."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
            ],
        },
        {
            "id": "c",
            "conversations": [
                {"from": "system", "value": "Be kind."},
                {"from": "USER", "value": "Hi"},
                {"from": "chatgpt", "value": "Hello!"},
            ],
        },
    ]
    path = write_jsonl(tmp_path / "mixed.jsonl", records)
    conversations, report = load_conversations(settings(path))
    assert [c.id for c in conversations] == ["a", "b", "c"]
    assert all(c.messages == EXPECTED for c in conversations)
    assert report.formats == {"sharegpt": 2, "openai": 1}
    ultra = write_jsonl(tmp_path / "ultra.jsonl", [{"id": "u", "data": ["Hi", "Hello!", "More?", "Sure."]}])
    [conversation], _ = load_conversations(settings(ultra, format="ultrachat"))
    assert [m["role"] for m in conversation.messages] == ["user", "assistant", "user", "assistant"]


def test_json_parquet_and_saved_dataset_directories_load_alike(tmp_path):
    import datasets

    records = [
        {
            "id": r["id"],
            "messages": [
                {"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
                for t in r["conversations"]
            ],
        }
        for r in chat_records(6)
    ]
    (tmp_path / "chats.json").write_text(json.dumps(records))
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "chats.parquet"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(str(tmp_path / "saved"))
    loaded = [
        load_conversations(settings(tmp_path / name))[0] for name in ("chats.json", "chats.parquet", "saved")
    ]
    assert loaded[0] == loaded[1] == loaded[2]
    assert [c.id for c in loaded[0]] == [r["id"] for r in records]
    with pytest.raises(SourceError, match="no split 'test'.*data.split"):
        load_conversations(settings(tmp_path / "saved", split="test"))


def test_unusable_records_are_dropped_and_counted(tmp_path):
    good = {"id": "ok", "conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]}
    records = [
        good,
        {"id": "tool", "conversations": [{"from": "human", "value": "Q"}, {"from": "tool", "value": "x"}]},
        {"id": "noanswer", "conversations": [{"from": "human", "value": "Q"}]},
        {"id": "empty", "conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "  "}]},
        {"id": "ok", "conversations": [{"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A2"}]},
        {
            "id": "lead",
            "conversations": [
                {"from": "gpt", "value": "cont."},
                {"from": "human", "value": "Q"},
                {"from": "gpt", "value": "A"},
                {"from": "human", "value": "dangling"},
            ],
        },
        {"title": "no conversation at all"},
    ]
    conversations, report = load_conversations(settings(write_jsonl(tmp_path / "d.jsonl", records)))
    assert [c.id for c in conversations] == ["ok", "lead"]
    assert [m["content"] for m in conversations[1].messages] == [
        "Q",
        "A",
    ]  # leading answer, dangling question cut
    assert report.dropped == {
        "unknown_role": 1,
        "no_assistant_turn": 1,
        "empty_turn": 1,
        "duplicate_id": 1,
        "unknown_layout": 1,
    }
    assert report.trimmed == {"leading_assistant_turns": 1, "trailing_user_turns": 1}
    assert "record #1 (id 'tool')" in report.examples["unknown_role"][0]


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (
            {"id": "r", "conversations": [{"from": "human", "value": "Q"}, {"from": "robot", "value": "A"}]},
            r"record #1 \(id 'r'\): unknown role 'robot'.*data.on_invalid=drop",
        ),
        (
            {"id": "r", "conversations": [{"from": "human", "value": "Q"}]},
            r"record #1 \(id 'r'\).*no assistant turn.*\[no_assistant_turn\]",
        ),
    ],
)
def test_on_invalid_error_names_the_record(tmp_path, record, message):
    good = {"id": "g", "conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [good, record])
    with pytest.raises(SourceError, match=message):
        load_conversations(settings(path, on_invalid="error"))


def test_malformed_json_line_is_reported_with_its_line_number(tmp_path):
    path = tmp_path / "broken.jsonl"
    lines = [json.dumps(r) for r in chat_records(3)]
    lines.insert(2, '{"id": "x", "conversations": [')
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SourceError, match=r"broken.jsonl line 3: not valid JSON.*Fix or remove"):
        load_conversations(settings(path))


def test_missing_file_and_unknown_type_are_explained(tmp_path):
    with pytest.raises(SourceError, match="does not exist"):
        load_conversations(settings(tmp_path / "nope.jsonl"))
    (tmp_path / "chats.csv").write_text("a,b\n")
    with pytest.raises(SourceError, match="unknown file type '.csv'"):
        load_conversations(settings(tmp_path / "chats.csv"))


def test_builtin_sharegpt_recovers_every_whole_conversation():
    conversations, report = load_conversations(DataSettings())
    assert report.records == 17671  # the truncated file's complete elements
    assert report.kept == len(conversations) > 17000
    assert sum(report.dropped.values()) == report.records - report.kept
    assert all(c.messages[-1]["role"] == "assistant" for c in conversations)


def test_split_is_by_id_only_and_never_leaks(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", chat_records(200))
    conversations, _ = load_conversations(settings(path))
    train, heldout = split_conversations(conversations, 0.1, seed=0)
    assert not {c.id for c in train} & {c.id for c in heldout}
    assert len(train) + len(heldout) == 200 and 5 <= len(heldout) <= 40
    fewer, _ = load_conversations(settings(path, max_conversations=50))
    _, heldout_fewer = split_conversations(fewer, 0.1, seed=0)
    assert {c.id for c in heldout_fewer} == {c.id for c in heldout if c.id in {f.id for f in fewer}}
    shuffled = list(reversed(conversations))
    assert {c.id for c in split_conversations(shuffled, 0.1, 0)[1]} == {c.id for c in heldout}
    assert heldout_score("x", 0) != heldout_score("x", 1)
