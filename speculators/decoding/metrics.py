"""What a decoding run measured, and the summary every report uses.

Two acceptance lengths, because they differ and papers mix them up:
  * ``acceptance_length_global``: all tokens produced by verify steps ÷ all verify steps (vLLM's "mean acceptance
    length" = 1 + accepted / drafts; long, easy generations weigh more);
  * ``acceptance_length_per_sample_mean``: the same ratio per prompt, then averaged over prompts.
Per-position acceptance at depth j: ``conditional`` = P(token j accepted | tokens 1..j-1 accepted);
``unconditional`` = accepted at j ÷ verify steps (what vLLM calls its per-position acceptance rate).
Acceptance counts every token the verifier accepted, including ones past EOS or max_new_tokens that the output
then drops (vLLM counts them the same way).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DecodingStats:
    max_depth: int = 0  # drafted positions per step (k for chains, the tree depth for trees)
    accepted: list[list[int]] = field(default_factory=list)  # per prompt: accepted drafts at each verify step
    generated: list[int] = field(default_factory=list)  # per prompt: tokens in the output
    wall_s: float = 0.0
    prefill_s: float = 0.0  # until each batch's first token (prompt forward); the rest is the decode phase
    verifier_s: float = 0.0
    draft_s: float = 0.0
    verifier_forwards: int = 0
    draft_forwards: int = 0

    def merge(self, other: DecodingStats) -> DecodingStats:
        return DecodingStats(
            max_depth=max(self.max_depth, other.max_depth),
            accepted=self.accepted + other.accepted,
            generated=self.generated + other.generated,
            wall_s=self.wall_s + other.wall_s,
            prefill_s=self.prefill_s + other.prefill_s,
            verifier_s=self.verifier_s + other.verifier_s,
            draft_s=self.draft_s + other.draft_s,
            verifier_forwards=self.verifier_forwards + other.verifier_forwards,
            draft_forwards=self.draft_forwards + other.draft_forwards,
        )

    @property
    def verify_steps(self) -> int:
        return sum(len(steps) for steps in self.accepted)

    def summary(self) -> dict[str, Any]:
        steps = self.verify_steps
        accepted = sum(sum(s) for s in self.accepted)
        per_sample = [1.0 + sum(s) / len(s) for s in self.accepted if s]
        tokens = sum(self.generated)
        decode_s = self.wall_s - self.prefill_s  # tokens after each prompt's first one, over the decode phase
        out: dict[str, Any] = {
            "num_prompts": len(self.generated),
            "generated_tokens": tokens,
            "tokens_per_s": tokens / self.wall_s if self.wall_s > 0 else None,
            "decode_tokens_per_s": (tokens - len(self.generated)) / decode_s if decode_s > 0 else None,
            "wall_s": self.wall_s,
            "prefill_s": self.prefill_s,
        }
        if self.max_depth == 0:  # plain decoding: nothing was drafted
            return out
        reached = [0] * self.max_depth
        hits = [0] * self.max_depth
        for row in self.accepted:
            for count in row:
                for j in range(self.max_depth):
                    reached[j] += count >= j
                    hits[j] += count >= j + 1
        out.update(
            acceptance_length_global=1.0 + accepted / steps if steps else None,
            acceptance_length_per_sample_mean=sum(per_sample) / len(per_sample) if per_sample else None,
            verify_steps=steps,
            accepted_drafts=accepted,
            per_position_acceptance_conditional=[
                h / r if r else None for h, r in zip(hits, reached, strict=True)
            ],
            per_position_acceptance_unconditional=[h / steps if steps else None for h in hits],
            verifier_s=self.verifier_s,
            draft_s=self.draft_s,
            verifier_forwards=self.verifier_forwards,
            draft_forwards=self.draft_forwards,
        )
        return out
