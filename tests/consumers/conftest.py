"""Drafts for SmolLM2 written by our format library, and ONE vLLM worker run that serves all of them.

Deterministic acceptance (docs/format.md "Serving and deterministic end-to-end checks"): a copy of SmolLM2 whose final
``model.norm.weight`` is zero has all-zero logits, so greedy decoding always emits token 0 (its ``<unk>``, not a stop
token; the runs also set ``ignore_eos``). A draft whose ``norm.weight`` is zero always proposes draft id 0. With
``d2t[0] == 0`` every proposal is accepted; with every offset shifted by one, draft id 0 means token 1 and none is.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculators.format.checkpoint import read_config
from speculators.models import Eagle3DraftModel
from speculators.vocab import DraftVocab, build_draft_vocab
from tests.conftest import require_consumer

DRAFT_VOCAB = 8192
SPECULATIVE_TOKENS = 3
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "user", "content": "Name three prime numbers."}],
]
GREEDY_TOKENS = 24
# One token comes from the prefill, then every verify step yields k + 1 when all drafts are accepted: 1 + 4 * 4.
ZERO_TOKENS = 1 + 4 * (SPECULATIVE_TOKENS + 1)


def draft_vocab_from_text(tokenizer, texts: list[str]) -> DraftVocab:
    """A real counts-based draft vocabulary (token 0 kept: the zero verifier's only output)."""
    counts = torch.zeros(len(tokenizer), dtype=torch.long)
    for text in texts:
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        counts += torch.bincount(ids, minlength=len(tokenizer))
    counts[0] = int(counts.max()) + 1
    return build_draft_vocab(counts, DRAFT_VOCAB, provenance={"source": "tests/consumers"})


def shifted(vocab: DraftVocab) -> DraftVocab:
    """The same vocabulary moved up by one id: a valid mapping in which draft id 0 means token 1, not 0."""
    targets = vocab.target_ids + 1
    assert int(targets.max()) < vocab.vocab_size
    t2d = torch.zeros_like(vocab.t2d)
    t2d[targets] = True
    return DraftVocab(d2t=vocab.d2t + 1, t2d=t2d, provenance=dict(vocab.provenance, shifted=1))


def build_smollm2_draft(
    smollm2_dir: Path,
    verifier_ref: Path,
    vocab: DraftVocab,
    seed: int,
    zero_norm: bool = False,
    model_class: type[Eagle3DraftModel] = Eagle3DraftModel,
    speculative_tokens: int = SPECULATIVE_TOKENS,
    **config_fields,
) -> Eagle3DraftModel:
    """A random draft of the EAGLE-3 family (``model_class``; ``config_fields``: its config's own, e.g. P-EAGLE's
    mask token) for SmolLM2 with the verifier's real embedding copied in."""
    torch.manual_seed(seed)
    config = model_class.config_class.from_verifier(
        read_config(smollm2_dir),
        str(verifier_ref),
        draft_vocab_size=DRAFT_VOCAB,
        speculative_tokens=speculative_tokens,
        **config_fields,
    )
    model = model_class(config)
    model.set_vocab(vocab.d2t, vocab.t2d)
    embedding = load_file(str(smollm2_dir / "model.safetensors"))["model.embed_tokens.weight"]
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embedding.float())
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)  # not the init ones: a misread norm would show
        if zero_norm:
            model.norm.weight.zero_()
    return model


def zero_logit_copy(smollm2_dir: Path, target: Path) -> Path:
    """SmolLM2 with its final norm zeroed: every logit is 0, greedy decoding always emits token 0."""
    target.mkdir(parents=True)
    for path in smollm2_dir.iterdir():
        if path.is_file() and path.name != "model.safetensors":
            shutil.copy2(path, target / path.name)
    weights = load_file(str(smollm2_dir / "model.safetensors"))
    weights["model.norm.weight"] = torch.zeros_like(weights["model.norm.weight"])
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


@pytest.fixture(scope="session")
def consumer_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("consumers")


@pytest.fixture(scope="session")
def draft_vocab(smollm2_tokenizer) -> DraftVocab:
    texts = [message["content"] for chat in CHAT_PROMPTS for message in chat]
    texts.append(smollm2_tokenizer.apply_chat_template(CHAT_PROMPTS[0], tokenize=False))
    vocab = draft_vocab_from_text(smollm2_tokenizer, texts)
    assert int(vocab.d2t[0]) == 0
    return vocab


@pytest.fixture(scope="session")
def random_draft(smollm2_dir, draft_vocab, consumer_root) -> tuple[Eagle3DraftModel, Path]:
    """A random bf16 draft for SmolLM2, saved by ``save_pretrained``: (the model, its directory)."""
    model = build_smollm2_draft(smollm2_dir, smollm2_dir, draft_vocab, seed=0)
    return model, model.save_pretrained(consumer_root / "random-draft")


@pytest.fixture(scope="session")
def zero_verifier_dir(smollm2_dir, consumer_root) -> Path:
    return zero_logit_copy(smollm2_dir, consumer_root / "smollm2-zero-logits")


@pytest.fixture(scope="session")
def accept_draft_dir(smollm2_dir, zero_verifier_dir, draft_vocab, consumer_root) -> Path:
    """Zero norm, d2t[0] = 0, verifier = the zero-logit SmolLM2 (served from its own directory: auto mode)."""
    model = build_smollm2_draft(smollm2_dir, zero_verifier_dir, draft_vocab, seed=1, zero_norm=True)
    return model.save_pretrained(consumer_root / "accept-draft")


@pytest.fixture(scope="session")
def reject_draft_dir(smollm2_dir, zero_verifier_dir, draft_vocab, consumer_root) -> Path:
    """The accepting draft with its vocabulary shifted by one: draft id 0 now proposes token 1."""
    model = build_smollm2_draft(smollm2_dir, zero_verifier_dir, shifted(draft_vocab), seed=1, zero_norm=True)
    assert int(model.draft_to_target(torch.tensor(0))) == 1
    return model.save_pretrained(consumer_root / "reject-draft")


@pytest.fixture(scope="session")
def vllm_runs(
    smollm2_dir, random_draft, zero_verifier_dir, accept_draft_dir, reject_draft_dir, consumer_root
):
    """Every configuration in ONE vLLM worker process (vLLM imported once, engines one after another).

    fp32 for the greedy comparisons (bf16 batch numerics change some greedy tokens, docs/environment.md); the
    deterministic-acceptance runs use bf16, vLLM's serving dtype, since zero logits are exact in any dtype.
    """
    from speculators.serving import VllmRequest, eagle3_speculative_config, run_vllm, vllm_available

    require_consumer(vllm_available(), "the vLLM virtualenv", "vllm-env")

    _, random_dir = random_draft
    greedy = dict(prompts=CHAT_PROMPTS, max_tokens=GREEDY_TOKENS, dtype="float32", max_model_len=512)
    zero = dict(prompts=CHAT_PROMPTS[:2], max_tokens=ZERO_TOKENS, ignore_eos=True, max_model_len=512)
    zero["dtype"] = "bfloat16"  # named: VllmRequest's default is "auto" (speculators.precision)
    requests = [
        VllmRequest(name="plain", model=smollm2_dir, **greedy),
        VllmRequest(name="draft-dir", model=random_dir, **greedy),
        VllmRequest(
            name="speculative-config",
            model=smollm2_dir,
            speculative_config=eagle3_speculative_config(random_dir, 2),
            **greedy,
        ),
        VllmRequest(name="accept", model=accept_draft_dir, **zero),
        VllmRequest(
            name="reject",
            model=zero_verifier_dir,
            speculative_config=eagle3_speculative_config(reject_draft_dir, SPECULATIVE_TOKENS),
            **zero,
        ),
    ]
    results = run_vllm(requests, timeout=900, log_path=consumer_root / "vllm-worker.log")
    return {result.name: result for result in results}
