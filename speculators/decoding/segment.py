"""What the engine hands every drafter each round: the confirmed positions the draft has not read yet."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Segment:
    """Confirmed positions the draft has not read yet (columns beyond a row's count are holes)."""

    features: torch.Tensor  # [B, S, n_aux * H] verifier aux states at positions t
    tokens: torch.Tensor  # [B, S] token x_{t+1}
    positions: torch.Tensor  # [B, S] t
    valid: torch.Tensor  # [B, S] bool

    @property
    def last(self) -> torch.Tensor:
        """Index of each row's last valid column."""
        return self.valid.long().cumsum(dim=1).argmax(dim=1)

    def select_rows(self, rows: torch.Tensor) -> Segment:
        return Segment(self.features[rows], self.tokens[rows], self.positions[rows], self.valid[rows])
