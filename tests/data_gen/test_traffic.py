"""Issue 41: served traffic as a data_gen source. Every log shape becomes the conversation that was served; a line
that is malformed, another model's or recorded without texts is one error naming the file, its line and the fix;
identical conversations are kept once; ``data.heldout_by=time`` holds out the latest window, identified by a hash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_gen.pipeline import run_data_gen
from data_gen.sources import (
    Conversation,
    DataSettings,
    SourceError,
    load_conversations,
    split_by_time,
    split_source,
)
from data_gen.store import HELDOUT_CONVERSATIONS_NAME
from data_gen.traffic import PLACEHOLDER, window_summary
from tests.data_gen.conftest import chat_records, write_jsonl
from tests.data_gen.test_user_errors import make_config, run_data_gen_script

VERIFIER = "HuggingFaceTB/SmolLM2-135M-Instruct"


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]


def completion(
    answer: str, created: int = 1_700_000_000, model: str = "SmolLM2-135M-Instruct", **extra
) -> dict:
    return {
        "id": f"chatcmpl-{created}-{answer}",
        "object": "chat.completion",
        "model": model,
        "created": created,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 3},
        **extra,
    }


def nested(question: str, answer: str, temperature: float | None = 0.7, **response) -> dict:
    request = {"model": "SmolLM2-135M-Instruct", "messages": chat(question)}
    if temperature is not None:
        request["temperature"] = temperature
    return {"request": request, "response": completion(answer, **response)}


def eval_row(question: str, answer: str | None, run: str = "plain", created: float = 1_700_000_100.5) -> dict:
    """A row of `speculators eval`'s requests.jsonl, with its texts unless ``answer`` is None."""
    row = {
        "request": 0,
        "suite": "chats",
        "category": "chats",
        "prompt_id": "0",
        "turn": 1,
        "prompt_tokens": 12,
        "output_tokens": 4,
        "engine": "ours" if run != "plain" else "plain",
        "run": run,
        "method": "chain",
        "k": 1,
        "concurrency": 1,
        "batch": 0,
        "accepted_per_step": [1, 0],
        "drafted_per_step": [1, 1],
        "timing": {"wall_s": 0.1},
    }
    if answer is not None:
        row |= {"messages": [{"role": "user", "content": question}], "output_text": answer}
        row |= {"model": VERIFIER, "created": created, "temperature": 0.0, "finish_reason": "length"}
    return row


def served(path: Path, **overrides) -> DataSettings:
    return DataSettings.from_mapping({"source": str(path), **overrides})


def load(path: Path, regenerate: bool = False, **overrides) -> tuple[list[Conversation], object]:
    return load_conversations(served(path, **overrides), verifier=VERIFIER, regenerate=regenerate)


# ---- 1. every shape -------------------------------------------------------------------------------------------
def test_openai_pairs_nested_and_flat_are_the_served_conversations(tmp_path):
    flat_response = {"messages": chat("Flat?"), "response": completion("Flat.", created=1_700_000_002)}
    flat_choices = {
        **completion("Choices.", created=1_700_000_003),
        "messages": chat("Choices?"),
        "temperature": 0,
    }
    records = [nested("Nested?", "Nested.", created=1_700_000_001), flat_response, flat_choices]
    for fmt in ("served", "auto"):
        conversations, report = load(write_jsonl(tmp_path / "traffic.jsonl", records), format=fmt)
        assert [c.messages for c in conversations] == [
            [*chat(q), {"role": "assistant", "content": a}]
            for q, a in [("Nested?", "Nested."), ("Flat?", "Flat."), ("Choices?", "Choices.")]
        ]
        assert [c.created for c in conversations] == [1_700_000_001.0, 1_700_000_002.0, 1_700_000_003.0]
        assert conversations[0].id == records[0]["response"]["id"]  # the response's id
        assert [c.meta.get("temperature") for c in conversations] == [0.7, None, 0.0]
        assert report.formats == {"served": 3} and report.dropped == {}
        assert report.to_json()["temperatures"] == {"0.7": 1, "unknown": 1, "0": 1}


def test_an_answer_cut_at_max_tokens_keeps_its_end_of_turn_out_of_the_loss(tmp_path):
    record = nested("Long?", "It goes on and", temperature=None)
    record["response"]["choices"][0]["finish_reason"] = "length"
    [conversation], _ = load(write_jsonl(tmp_path / "traffic.jsonl", [record]))
    assert conversation.messages[-1] == {"role": "assistant", "content": "It goes on and", "truncated": True}


def test_eval_rows_with_texts_are_served_conversations_and_runs_are_duplicates(tmp_path):
    rows = [
        eval_row("Hi?", "Hello."),
        eval_row("Hi?", "Hello.", run="chain-k1"),
        eval_row("Why?", "Because."),
    ]
    conversations, report = load(write_jsonl(tmp_path / "requests.jsonl", rows))
    assert [c.messages[-1]["content"] for c in conversations] == ["Hello.", "Because."]
    assert conversations[0].messages[0] == {"role": "user", "content": "Hi?"}
    assert conversations[0].messages[-1]["truncated"] is True  # finish_reason "length"
    assert conversations[0].created == 1_700_000_100.5
    assert report.dropped == {"duplicate": 1} and report.temperatures == {"0": 2}


def test_bare_prompts_are_kept_for_regeneration_with_a_placeholder_answer(tmp_path):
    records = [{"prompt": "Name a colour.", "created": 5}, {"messages": chat("And a fruit?"), "created": 6}]
    conversations, report = load(write_jsonl(tmp_path / "prompts.jsonl", records), regenerate=True)
    assert [c.messages for c in conversations] == [
        [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": PLACEHOLDER}],
        [*chat("And a fruit?"), {"role": "assistant", "content": PLACEHOLDER}],
    ]
    assert report.formats == {"served_prompt": 2}


def test_a_chat_dataset_with_a_prompt_column_is_not_taken_for_a_log(tmp_path):
    """UltraChat-200k's rows carry "prompt" beside their "messages": auto keeps reading them as chats."""
    records = [
        {
            "prompt": "Q",
            "prompt_id": f"p{i}",
            "messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": f"A{i}"}],
        }
        for i in range(2)
    ]
    conversations, report = load(write_jsonl(tmp_path / "chats.jsonl", records))
    assert report.formats == {"openai": 2} and [c.id for c in conversations] == ["p0", "p1"]


# ---- 2. refusals, one line naming the line -----------------------------------------------------------------------
MALFORMED = [
    ("[1, 2]", "a list, not a JSON object"),
    (
        json.dumps({"messages": chat("Q"), "response": {"id": "x", "choices": []}}),
        "the response has no 'choices'",
    ),
    (
        json.dumps({"messages": chat("Q"), "choices": [{"message": {"role": "assistant", "content": None}}]}),
        "content is none, not text",
    ),
    (
        json.dumps({**nested("Q", "A"), "response": completion("A", created="yesterday")}),
        "'created' is 'yesterday'",
    ),
    (
        json.dumps({"request": {"model": "m"}, "response": completion("A")}),
        "the request has no 'messages' list",
    ),
]


@pytest.mark.parametrize(("line", "problem"), MALFORMED)
@pytest.mark.parametrize("on_invalid", ["drop", "error"])
def test_a_malformed_line_is_refused_with_its_line_number_whatever_on_invalid_says(
    tmp_path, line, problem, on_invalid
):
    path = tmp_path / "traffic.jsonl"
    good = [json.dumps(nested(f"Q{i}", f"A{i}")) for i in range(3)]
    path.write_text("\n".join([*good[:2], "", line, good[2]]) + "\n")  # the bad record is line 4
    with pytest.raises(SourceError) as refused:
        load(path, on_invalid=on_invalid)
    message = str(refused.value)
    assert "\n" not in message and f"{path} line 4: " in message and problem in message
    assert "whatever data.on_invalid says" in message and "fix or remove that line" in message


def test_traffic_of_another_model_is_refused_naming_the_setting(tmp_path):
    records = [nested("Q0", "A0"), nested("Q1", "A1"), nested("Q2", "A2", model="gpt-4o")]
    path = write_jsonl(tmp_path / "traffic.jsonl", records)
    with pytest.raises(SourceError) as refused:
        load_conversations(served(path), verifier="smollm2")
    assert str(refused.value) == (
        f"{path} line 1: served by 'SmolLM2-135M-Instruct', not this verifier 'smollm2'; keep only this verifier's "
        "traffic, or set data.served_model=<name> if that is the name it is served under"
    )
    with pytest.raises(
        SourceError, match=r"traffic.jsonl line 3: served by 'gpt-4o', not this verifier 'HuggingF"
    ):
        load(path)  # the full name and its last component both match the first two


def test_served_model_names_the_verifier_and_a_record_without_model_passes(tmp_path):
    records = [
        nested("Q0", "A0", model="smol-prod"),
        {"messages": chat("Q1"), "choices": completion("A1")["choices"]},
    ]
    records[0]["request"]["model"] = "smol-prod"
    path = write_jsonl(tmp_path / "traffic.jsonl", records)
    conversations, _ = load_conversations(served(path, served_model="smol-prod"), verifier="smollm2")
    assert [c.meta.get("model") for c in conversations] == ["smol-prod", None]
    with pytest.raises(SourceError, match="line 1: served by 'smol-prod', not this verifier 'smollm2'"):
        load_conversations(served(path), verifier="smollm2")


def test_an_eval_row_without_texts_says_to_rerun_with_keep_texts(tmp_path):
    path = write_jsonl(tmp_path / "requests.jsonl", [eval_row("Hi?", "Hello."), eval_row("Hi?", None)])
    with pytest.raises(
        SourceError,
        match=r"requests.jsonl line 2: a `speculators eval` request row without texts.*"
        r"rerun eval with --keep-texts",
    ):
        load(path)


def test_bare_prompts_without_regeneration_are_refused_never_trained_on_a_placeholder(tmp_path):
    path = write_jsonl(tmp_path / "prompts.jsonl", [nested("Q", "A"), {"prompt": "Name a colour."}])
    with pytest.raises(SourceError) as refused:
        load(path, regenerate=False)
    message = str(refused.value)
    assert message.startswith(f"{path} line 2: a prompt without a served answer")
    assert "set data_gen.regenerate.enabled=true" in message and "\n" not in message


def test_the_data_gen_entry_point_ends_a_bad_log_in_one_error_line(tiny_llama_dir, tmp_path):
    path = write_jsonl(tmp_path / "traffic.jsonl", [nested("Q0", "A0", model=tiny_llama_dir.name), "oops"])
    overrides = [
        f"verifier.name_or_path={tiny_llama_dir}",
        f"data.source={path}",
        f"data_gen.output_dir={tmp_path}/d",
    ]
    result = run_data_gen_script(tmp_path, overrides)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{path} line 2: a str, not a JSON object" in errors[0]
    assert not (tmp_path / "d").exists()


# ---- 3. duplicates ------------------------------------------------------------------------------------------------
def test_identical_conversations_are_dropped_keeping_the_earliest(tmp_path):
    late, early = nested("Q", "A", created=200), nested("Q", "A", created=100)
    records = [late, nested("Other", "B", created=150), early, nested("Q", "A", created=300)]
    conversations, report = load(write_jsonl(tmp_path / "traffic.jsonl", records))
    assert report.dropped == {"duplicate": 2} and report.kept == 2
    assert [(c.messages[-2]["content"], c.created) for c in conversations] == [("Q", 100.0), ("Other", 150.0)]
    assert conversations[0].id == early["response"]["id"]


def test_duplicates_are_counted_not_refused_with_on_invalid_error(tmp_path):
    path = write_jsonl(tmp_path / "requests.jsonl", [eval_row("Hi?", "Hello.")] * 3)
    conversations, report = load(path, on_invalid="error")
    assert len(conversations) == 1 and report.to_json()["dropped"] == {"duplicate": 2}


# ---- 4. the later window held out -----------------------------------------------------------------------------------
def out_of_order_log(directory: Path, count: int = 20, answer=lambda i: f"Answer {i}.") -> Path:
    """``count`` served requests written in a shuffled order: request i was served at time 1000 + i."""
    order = [(7 * i) % count for i in range(count)]  # 7 is coprime with 20: a permutation
    records = [nested(f"Question {i}?", answer(i), created=1000 + i) for i in order]
    directory.mkdir(parents=True, exist_ok=True)
    return write_jsonl(directory / "traffic.jsonl", records)


def test_heldout_by_time_holds_out_exactly_the_latest_fraction(tmp_path):
    settings = served(out_of_order_log(tmp_path), heldout_by="time", heldout_fraction=0.25)
    conversations, report = load_conversations(settings, verifier=VERIFIER)
    train, heldout = split_source(conversations, settings, report)
    assert [c.created for c in heldout] == [1015.0, 1016.0, 1017.0, 1018.0, 1019.0]
    assert [c.created for c in train] == [1000.0 + i for i in range(15)]
    windows = report.to_json()["windows"]
    assert report.to_json()["ordered_by"] == "created"
    assert (
        windows["train"]["count"],
        windows["train"]["first_created"],
        windows["train"]["last_created"],
    ) == (
        15,
        1000.0,
        1014.0,
    )
    assert (windows["heldout"]["count"], windows["heldout"]["first_created"]) == (5, 1015.0)
    assert windows["heldout"] == window_summary(heldout) and "Question" not in json.dumps(windows)


def test_window_hashes_are_stable_and_change_with_one_record(tmp_path):
    def windows(path: Path) -> dict:
        settings = served(path, heldout_by="time", heldout_fraction=0.25)
        conversations, report = load_conversations(settings, verifier=VERIFIER)
        split_source(conversations, settings, report)
        return report.windows

    first = windows(out_of_order_log(tmp_path / "a"))
    again = windows(out_of_order_log(tmp_path / "b"))
    assert first == again and len(first["heldout"]["sha256"]) == 64
    changed = windows(
        out_of_order_log(tmp_path / "c", answer=lambda i: "Changed." if i == 17 else f"Answer {i}.")
    )
    assert changed["train"] == first["train"]
    assert changed["heldout"]["sha256"] != first["heldout"]["sha256"]
    assert changed["heldout"]["count"] == first["heldout"]["count"]


def test_without_times_the_line_order_is_the_order(tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", chat_records(8))
    settings = DataSettings.from_mapping(
        {"source": str(path), "heldout_by": "time", "heldout_fraction": 0.25}
    )
    conversations, report = load_conversations(settings)
    train, heldout = split_source(conversations, settings, report)
    assert [c.id for c in heldout] == ["c006", "c007"] and len(train) == 6
    assert report.ordered_by == "line" and report.windows["heldout"]["first_created"] is None


def test_some_records_with_a_time_and_some_without_are_refused(tmp_path):
    records = [
        nested("Q0", "A0", created=5),
        {"messages": chat("Q1"), "choices": completion("A1")["choices"]},
    ]
    path = write_jsonl(tmp_path / "traffic.jsonl", records)
    settings = served(path, heldout_by="time")
    conversations, report = load_conversations(settings, verifier=VERIFIER)
    with pytest.raises(
        SourceError, match=r"1 of 2 records have a 'created' time.*e.g. .*traffic.jsonl line 2\)"
    ):
        split_source(conversations, settings, report)
    train, heldout = split_source(conversations, served(path), report)  # heldout_by=id does not need them
    assert len(train) + len(heldout) == 2


def test_holding_out_everything_by_time_names_the_setting():
    conversations = [Conversation(f"c{i}", [], created=float(i)) for i in range(2)]
    with pytest.raises(SourceError, match=r"data.heldout_fraction=0.8 held out all 2 conversations"):
        split_by_time(conversations, 0.8)


def test_data_gen_on_a_log_records_the_windows_and_the_held_out_times(tiny_llama_dir, tmp_path):
    count = 8
    records = [nested(f"Question {i}?", f"Answer {i}.", created=1000 + (5 * i) % count) for i in range(count)]
    for record in records:
        record["request"]["model"] = record["response"]["model"] = tiny_llama_dir.name
    source = write_jsonl(tmp_path / "traffic.jsonl", records)
    out = tmp_path / "data"
    summary = run_data_gen(make_config(tiny_llama_dir, source, out, heldout_by="time", heldout_fraction=0.25))
    assert summary["conversations"] == {"train": 6, "heldout": 2}
    assert summary["source"]["windows"]["heldout"]["first_created"] == 1006.0
    assert summary["source"]["temperatures"] == {"0.7": count}
    lines = [json.loads(line) for line in (out / HELDOUT_CONVERSATIONS_NAME).read_text().splitlines()]
    assert [line["created"] for line in lines] == [1006.0, 1007.0]


def test_a_conversation_line_of_another_source_has_no_created_key():
    assert Conversation("c", [{"role": "user", "content": "Q"}]).to_json() == {
        "id": "c",
        "messages": [{"role": "user", "content": "Q"}],
    }


def test_regeneration_answers_bare_prompts_in_place_of_the_placeholder(tiny_llama_dir, tmp_path):
    records = [{"prompt": f"Name colour number {i}.", "created": 1000 + i} for i in range(6)]
    out = tmp_path / "data"
    config = make_config(tiny_llama_dir, write_jsonl(tmp_path / "prompts.jsonl", records), out)
    config["data_gen"]["regenerate"] = {"enabled": True, "backend": "transformers", "max_new_tokens": 3}
    summary = run_data_gen(config)
    assert sum(summary["samples"].values()) > 0 and summary["source"]["formats"] == {"served_prompt": 6}
    regenerated = [
        json.loads(line) for path in (out / "regenerated").rglob("*.jsonl") for line in path.open()
    ]
    answers = [m for entry in regenerated for m in entry.get("messages", []) if m["role"] == "assistant"]
    assert answers and all(m["content"] != PLACEHOLDER for m in answers)
