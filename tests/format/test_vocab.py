"""Draft vocabulary: most frequent assistant tokens, ties to the lower id, d2t as offsets, provenance enforced."""

from __future__ import annotations

import pytest
import torch

from speculators.vocab import DraftVocab, build_draft_vocab, tokenizer_fingerprint


def test_selects_most_frequent_with_ties_to_lower_id():
    counts = torch.tensor([0, 5, 3, 5, 0, 9, 3, 0])
    vocab = build_draft_vocab(counts, 4)
    # 5 (9), then 1 and 3 (5 each), then the tie at 3 between ids 2 and 6 goes to 2.
    assert vocab.target_ids.tolist() == [1, 2, 3, 5]
    assert vocab.d2t.tolist() == [1, 1, 1, 2]  # offsets: target - draft id
    assert vocab.t2d.nonzero().flatten().tolist() == [1, 2, 3, 5]


def test_unseen_ids_pad_from_the_lowest():
    counts = torch.tensor([0, 0, 7, 0, 0, 0])
    vocab = build_draft_vocab(counts, 3)
    assert vocab.target_ids.tolist() == [0, 1, 2]
    assert vocab.d2t.tolist() == [0, 0, 0]


def test_rejects_sizes_outside_the_vocab():
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_draft_vocab(torch.ones(10), 11)


def test_save_load_and_provenance_check(tmp_path, smollm2_tokenizer):
    fingerprint = tokenizer_fingerprint(smollm2_tokenizer)
    vocab = build_draft_vocab(torch.arange(100), 10, {"tokenizer_fingerprint": fingerprint})
    vocab.save(tmp_path / "vocab.safetensors")
    loaded = DraftVocab.load(tmp_path / "vocab.safetensors")
    assert torch.equal(loaded.d2t, vocab.d2t) and torch.equal(loaded.t2d, vocab.t2d)
    loaded.check_compatible(fingerprint, 10)
    with pytest.raises(ValueError, match="tokenizer"):
        loaded.check_compatible("0" * 64, 10)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        loaded.check_compatible(fingerprint, 12)


def test_a_damaged_draft_vocab_file_is_named_with_the_fix(tmp_path):
    """draft_vocab.safetensors truncated (a full disk): one ValueError naming the file, not safetensors' own."""
    from speculators.vocab import DraftVocab

    path = tmp_path / "draft_vocab.safetensors"
    vocab = build_draft_vocab(torch.randint(1, 100, (1000,)), 100)
    vocab.save(path)
    assert torch.equal(DraftVocab.load(path).t2d, vocab.t2d)
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(
        ValueError, match="draft_vocab.safetensors: cannot be read .*re-export or re-download"
    ):
        DraftVocab.load(path)
    assert [p.name for p in tmp_path.iterdir()] == ["draft_vocab.safetensors"]  # the save left no temporary
