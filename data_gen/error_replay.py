"""On-policy error replay: weight up the tokens where the current draft was rejected (Draft-OPD style).

Regeneration through our own speculative decoding engine (``data_gen.regenerate.backend: engine``) answers with
the verifier's greedy continuation, which is what the other back ends give too (decoding is lossless), and also
records, per verify step, how many drafted tokens the verifier accepted. Where a chain was cut, the draft's token
was wrong on this very traffic: those are the positions worth more of the draft's training signal.

The path of a rejection through data_gen, and the conventions at each hop:

1. engine → output indices (:func:`rejected_positions`). Output token 0 comes from the prefill (never drafted);
   verify step s drafted ``k`` tokens starting at output index ``p_s`` (``p_0 = 1``, ``p_{s+1} = p_s + a_s + 1``)
   and accepted ``a_s`` of them. When ``a_s < k`` the draft's token at ``p_s + a_s`` was rejected and the
   verifier's own token stands there. The last step may have been cut by EOS or ``max_new_tokens``: a rejected
   index at or past the output's end is dropped.
2. output indices → character offsets in the answer text (:func:`rejected_char_offsets`): where the token starts
   in ``decode(tokens)``, found by decoding token prefixes (text is what the masker re-tokenises; the token ids
   may merge differently there). A rejected token that adds no visible character (whitespace only, a special
   token, a byte of a character that a later token completes) is moved to the next content character, which is
   the error the draft will see as a content token. When no content follows, the offset is the end of the text:
   that stands for the end-of-turn token that closes the answer, kept only when the answer ended with a stop token
   (a cut answer has none to emphasise).
3. stored offsets are into the STRIPPED content (:func:`strip_offsets`), as the Regenerator stores the message:
   ``"rejected_at": [..]``, an offset ``== len(content)`` meaning the end-of-turn token.
4. character offsets → per-token weights of an encoded sample (:func:`replay_weights`, called by the masker, which
   finds where the content sits in the rendered text): ``replay_weight`` on the loss token holding each offset,
   1.0 on the other loss tokens, 0 outside the loss mask; :func:`normalized` then scales them to a mean of 1.0 over
   the sample's loss tokens, so the loss scale stays and only the emphasis moves.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence


def rejected_positions(accepted_per_step: Sequence[int], k: int, num_tokens: int) -> list[int]:
    """Output indices (``< num_tokens``) where the verifier rejected a drafted token, in order."""
    positions = []
    start = 1  # output token 0 is the prefill's
    for accepted in accepted_per_step:
        if not 0 <= accepted <= k:
            raise ValueError(f"a verify step accepted {accepted} of k={k} drafted tokens")
        if accepted < k and start + accepted < num_tokens:
            positions.append(start + accepted)
        start += accepted + 1
        if start >= num_tokens:
            break
    return positions


def rejected_char_offsets(
    decode: Callable[[list[int]], str], tokens: Sequence[int], positions: Sequence[int], ended: bool
) -> tuple[str, tuple[int, ...]]:
    """``decode(tokens)`` and the sorted, distinct character offsets in it of the tokens at ``positions`` (see the
    module docstring, step 2). ``ended``: the answer ended with a stop token, so an offset at the end of the text
    (a rejected stop token, or trailing whitespace before it) is kept; otherwise it is dropped."""
    tokens = list(tokens)
    text = decode(tokens)
    found = set()
    for position in positions:
        char = _content_char(text, _char_start(decode, tokens, position, text))
        if char < len(text) or ended:
            found.add(char)
    return text, tuple(sorted(found))


def _char_start(decode: Callable[[list[int]], str], tokens: list[int], position: int, text: str) -> int:
    """Where token ``position`` starts in ``text``: the length of the decoded prefix before it. A prefix that is
    not a prefix of ``text`` (it ends inside a multi-byte character, or the decoder cleans up spaces differently)
    is moved on to the next one that is."""
    for cut in range(position, len(tokens) + 1):
        prefix = decode(tokens[:cut])
        if text.startswith(prefix):
            return len(prefix)
    return len(text)


def _content_char(text: str, char: int) -> int:
    """The first non-whitespace character at or after ``char`` (``len(text)`` when none)."""
    while char < len(text) and text[char].isspace():
        char += 1
    return char


def strip_offsets(text: str, offsets: Sequence[int]) -> tuple[str, tuple[int, ...]]:
    """``text.strip()`` and ``offsets`` moved into it (the Regenerator stores stripped answers). An offset at the
    end of ``text`` becomes the end of the stripped text, i.e. still the end-of-turn token."""
    stripped = text.strip()
    lead = len(text) - len(text.lstrip())
    return stripped, tuple(sorted({min(max(o - lead, 0), len(stripped)) for o in offsets}))


def replay_weights(
    loss_mask: Sequence[int],
    offsets: Sequence[tuple[int, int]],
    rejected_chars: Sequence[int],
    replay_weight: float,
) -> list[float]:
    """Raw per-token weights of one sample (not yet normalised, see :func:`normalized`): ``replay_weight`` on the
    loss token holding each character of ``rejected_chars`` (absolute offsets in the tokenised text; a character
    between tokens goes to the next token), 1.0 on the other loss tokens, 0.0 outside the loss mask. ``offsets``
    are the tokenizer's ``(start, end)`` character spans, one per token."""
    weights = [1.0 if m else 0.0 for m in loss_mask]
    ends = [end for _, end in offsets]
    for char in rejected_chars:
        # the first token ending after ``char``: the one that holds it
        token = bisect.bisect_right(ends, char)
        if token < len(weights) and loss_mask[token]:
            weights[token] = float(replay_weight)
    return weights


def normalized(weights: Sequence[float], loss_mask: Sequence[int]) -> list[float]:
    """``weights`` scaled to a mean of 1.0 over the loss tokens (0.0 elsewhere): the weighted loss keeps the scale
    of the unweighted one, only the emphasis moves."""
    kept = [w for w, m in zip(weights, loss_mask, strict=True) if m]
    total = sum(kept)
    if not kept or total <= 0:
        return [1.0 if m else 0.0 for m in loss_mask]
    scale = len(kept) / total
    return [w * scale if m else 0.0 for w, m in zip(weights, loss_mask, strict=True)]


__all__ = ["normalized", "rejected_char_offsets", "rejected_positions", "replay_weights", "strip_offsets"]
