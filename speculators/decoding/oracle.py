"""The ceiling of speculative decoding: a drafter that proposes the verifier's own greedy continuation.

Why: an acceptance length or speed-up alone does not say how much is left to gain. Replaying, as the draft, what
the verifier itself writes greedily (decoded beforehand without a draft) makes every proposal accepted, so each
full verify step yields k + 1 tokens at no drafting cost; a draft's tokens/s against this run at the same k and
batch is the share of the reachable speed-up it achieved. A step is *full* when the continuation still has k
tokens after the step's root; near the end of an output the proposal is padded (and those pads may be rejected).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from speculators.decoding.segment import Segment
from speculators.decoding.tree import DraftTree, chain_tree


class OracleDrafter:
    """Proposes ``continuation[i + 1 : i + 1 + k]`` for a root at output index ``i`` of its row (greedy only)."""

    supports_tree = False

    def __init__(
        self, continuations: Sequence[Sequence[int]], prompt_lengths: Sequence[int], device: torch.device
    ) -> None:
        self.continuations = [list(c) for c in continuations]
        self.prompt_lengths = list(prompt_lengths)
        self.rows = list(range(len(self.continuations)))  # original row of each active row
        self.device = device
        self.seconds = 0.0  # no draft model runs
        self.forwards = 0

    def chain(
        self,
        segment: Segment,
        root: torch.Tensor,
        k: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> DraftTree:
        """The next ``k`` tokens of each row's greedy continuation after its root."""
        if temperature > 0:
            raise ValueError(
                "the oracle replays the greedy continuation: it is defined at temperature 0 only"
            )
        rows = torch.arange(root.shape[0], device=root.device)
        root_positions = (segment.positions[rows, segment.last] + 1).tolist()
        drafted = [
            self.proposal(original, position - self.prompt_lengths[original], k)
            for original, position in zip(self.rows, root_positions, strict=True)
        ]
        return chain_tree(root, torch.tensor(drafted, dtype=root.dtype, device=root.device))

    def proposal(self, row: int, index: int, k: int) -> list[int]:
        """``k`` tokens after output index ``index`` of ``row``, padded with its last token past the end."""
        continuation = self.continuations[row]
        tokens = continuation[index + 1 : index + 1 + k]
        pad = continuation[-1] if continuation else 0
        return tokens + [pad] * (k - len(tokens))

    def select_rows(self, rows: torch.Tensor) -> None:
        self.rows = [self.rows[i] for i in rows.tolist()]


def oracle_factory(continuations: dict[tuple[int, ...], list[int]]):
    """A drafter factory for :class:`SpeculativeDecoder` that looks each prompt's greedy continuation up."""

    def build(prompts: Sequence[Sequence[int]], device: torch.device) -> OracleDrafter:
        missing = [i for i, p in enumerate(prompts) if tuple(p) not in continuations]
        if missing:
            raise KeyError(
                f"the oracle has no greedy continuation for prompt rows {missing}: decode them plainly first"
            )
        return OracleDrafter([continuations[tuple(p)] for p in prompts], [len(p) for p in prompts], device)

    return build


def full_steps(continuation: Sequence[int], accepted_per_step: Sequence[int], k: int) -> list[bool]:
    """Which verify steps were full (the continuation held k tokens after the root), replaying the accepted counts
    from output index 0 (the prefill's token)."""
    index, full = 0, []
    for accepted in accepted_per_step:
        full.append(index + k < len(continuation))
        index += accepted + 1
    return full


__all__ = ["OracleDrafter", "full_steps", "oracle_factory"]
