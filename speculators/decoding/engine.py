"""Speculative decoding and plain decoding of an HF causal LM, with KV caches, batches and exact verification.

Both loops share the verifier plumbing (left-padded prefill, per-row positions, a 4D float mask over a cache with
per-row holes) so that "speculative vs plain" compares the same engine with and without a draft.

One speculative step for a batch:
  1. the draft reads the segment the verifier confirmed last step, then proposes a chain or a tree;
  2. the verifier runs once over ``[root, drafted…]`` with the tree mask, from its KV cache;
  3. the rule (greedy, or lossless rejection sampling) picks each row's accepted path and next token;
  4. the verifier cache keeps only the accepted path (compacted), the draft's speculative entries are dropped, and
     the accepted positions' aux states become the next segment.
Rows that finish (EOS or max_new_tokens) leave the batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from speculators.decoding.cache import VerifierCache
from speculators.decoding.drafters import algorithm_of, drafter_class
from speculators.decoding.lean import LeanForward, lean_supported
from speculators.decoding.metrics import DecodingStats
from speculators.decoding.sampling import sample, target_probs
from speculators.decoding.segment import Segment
from speculators.decoding.tree import DraftTree
from speculators.decoding.verify import RejectionSampler, Verdict, verify_greedy
from speculators.models.draft import DraftModel
from speculators.verifier import capture_aux_states, check_aux_layer_ids, decoder_layers


@dataclass(frozen=True)
class CacheColumns:
    """An upper bound on the verifier cache's columns and the terms it is made of: the (left-padded) prompt, then
    for each of ``max_new_tokens + 1`` verify steps at most, ``per_step`` columns (the verified tokens, rejected
    ones included: they stay in the cache, masked). Kept apart so that a refusal can show the sum it exceeded."""

    prompt: int
    max_new_tokens: int
    per_step: int
    per_step_term: str  # how the per-step columns are named in a message: "(k + 1)", "(tree budget + 1)", "1"
    per_step_value: str  # the same with the numbers: "(3 + 1)"

    @property
    def total(self) -> int:
        return self.prompt + (self.max_new_tokens + 1) * self.per_step

    def explain(self) -> str:
        """``prompt + (max_new_tokens + 1)·(k + 1)`` and the same with this run's numbers and their sum (plain
        decoding, one column per token: ``prompt + max_new_tokens + 1``)."""
        if self.per_step == 1:
            return f"prompt + max_new_tokens + 1 = {self.prompt} + {self.max_new_tokens} + 1 = {self.total}"
        return (
            f"prompt + (max_new_tokens + 1)·{self.per_step_term} = {self.prompt} + "
            f"({self.max_new_tokens} + 1)·{self.per_step_value} = {self.total}"
        )


@dataclass
class DecodingConfig:
    """How to draft and verify. ``method``: ``chain`` (k tokens) or ``tree`` (EAGLE-2 top-k expansion)."""

    method: str = "chain"
    num_speculative_tokens: int = 3  # chain length k
    tree_topk: int = 4  # children per expanded node, and nodes expanded per depth
    tree_depth: int = 4  # draft steps (= maximum drafted depth)
    tree_budget: int = 16  # drafted tokens kept in the verified tree (the verifier sees budget + 1)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 128

    def __post_init__(self) -> None:
        if self.method not in ("chain", "tree"):
            raise ValueError(f"decoding method {self.method!r}: use 'chain' or 'tree'")
        if min(self.num_speculative_tokens, self.tree_topk, self.tree_depth, self.tree_budget) < 1:
            raise ValueError("num_speculative_tokens, tree_topk, tree_depth and tree_budget must all be >= 1")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p {self.top_p} must be in (0, 1]")

    @property
    def max_depth(self) -> int:
        return self.num_speculative_tokens if self.method == "chain" else self.tree_depth

    def max_cache_columns(self, prompt_width: int) -> CacheColumns:
        """An upper bound on the verifier cache's columns for prompts ``prompt_width`` wide (``CacheColumns``)."""
        chain = self.method == "chain"
        drafted = self.num_speculative_tokens if chain else self.tree_budget
        return CacheColumns(
            prompt_width,
            self.max_new_tokens,
            drafted + 1,
            "(k + 1)" if chain else "(tree budget + 1)",
            f"({drafted} + 1)",
        )


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # per prompt, the generated ids (prompt excluded)
    stats: DecodingStats = field(default_factory=DecodingStats)


# ---- the verifier side ------------------------------------------------------------------------------------------
class VerifierRunner:
    """Forwards through the verifier's KV cache with explicit positions and masks, timing each call.

    Llama-family verifiers run through :class:`LeanForward` over a preallocated cache (the same formulas without the
    HF module stack, and faster matmuls on CPU); any other verifier through its own HF forward over a
    ``DynamicCache``. Either way, when ``aux_layer_ids`` are given, :attr:`aux` holds the last
    forward's aux states ``[B, Q, n_aux * H]`` (vLLM's layer-id convention). ``lean=False`` forces the HF forward
    (the reference the lean one is tested against); ``packed`` is :class:`LeanForward`'s (default: on CPU)."""

    def __init__(
        self,
        model: nn.Module,
        batch: int,
        aux_layer_ids: Sequence[int] = (),
        lean: bool = True,
        packed: bool | None = None,
        max_columns: CacheColumns | None = None,
    ) -> None:
        check_supported(model, max_columns)
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.lean = LeanForward(model, packed) if lean and lean_supported(model) else None
        static = self.lean.new_cache(batch) if self.lean is not None else None
        self.cache = VerifierCache(batch, self.device, static)
        self.aux_layer_ids = [int(i) for i in aux_layer_ids]
        if self.aux_layer_ids:
            check_aux_layer_ids(self.aux_layer_ids, len(decoder_layers(model)))
        self.aux: torch.Tensor | None = None
        self.seconds = 0.0
        self.forwards = 0

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        local: torch.Tensor,
        valid_new: torch.Tensor,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits ``[B, Q, V]`` of ``Q`` new tokens (``[B, 1, V]``, the last position only, with ``last_only``)."""
        start = time.perf_counter()
        if self.lean is not None:
            mask = self.cache.bool_mask(local)
            logits, self.aux = self.lean(
                ids, positions, self.cache.static, mask, self.aux_layer_ids, last_only
            )
        else:
            logits = self._hf_forward(ids, positions, local, last_only)
        self.cache.extend(valid_new)
        self.seconds += time.perf_counter() - start
        self.forwards += 1
        return logits

    def _hf_forward(
        self, ids: torch.Tensor, positions: torch.Tensor, local: torch.Tensor, last_only: bool
    ) -> torch.Tensor:
        wanted = self.aux_layer_ids
        with capture_aux_states(self.model, wanted) if wanted else nullcontext({}) as box:
            out = self.model(
                input_ids=ids,
                position_ids=positions,
                attention_mask=self.cache.attention_mask(local, self.dtype),
                cache=self.cache.cache,
                use_cache=True,
                logits_to_keep=1 if last_only else 0,
            )
        if self.aux_layer_ids:
            self.aux = box["states"].aux
        return out.logits

    def prefill(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded prompts through the verifier. Returns ``(logits[B, 1, V], ids[B, P], valid[B, P])``: the
        logits of the last column only (every row's last prompt token), as decoding needs no others."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token (apply the chat template first)")
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=self.device)
        valid = torch.zeros(len(prompts), width, dtype=torch.bool, device=self.device)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.as_tensor(list(prompt), device=self.device)
            valid[row, width - len(prompt) :] = True
        positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        local = (causal[None] & valid[:, None, :]) | torch.eye(width, dtype=torch.bool, device=self.device)[
            None
        ]
        return self.forward(ids, positions, local, valid, last_only=True), ids, valid


def check_supported(model: nn.Module, max_columns: CacheColumns | None = None) -> None:
    """Refuse verifiers whose cache we cannot steer: sliding-window layers crop their own cache, which breaks the
    per-row column layout and the tree masks. A window at least as wide as the cache can ever grow
    (``max_columns``) never crops, and such layers attend like full ones: the refusal names that limit with this
    run's numbers, and what to shorten. The settings are read via the verifier's family (a wrapper keeps them in
    ``text_config``)."""
    from speculators import families

    config = getattr(model, "config", None)
    settings = families.flat_config(config.to_dict()) if config is not None else {}
    layer_types = settings.get("layer_types") or []
    window = settings.get("sliding_window")
    sliding = any("sliding" in str(t) for t in layer_types) or (window and settings.get("use_sliding_window"))
    if not sliding:
        return
    if window and max_columns is not None and int(window) >= max_columns.total:
        return
    if not window or max_columns is None:
        raise ValueError(
            f"{type(model).__name__} uses sliding-window attention (window {window or 'unknown'}), which this engine "
            "supports only while its cache stays within the window; no bound on the cache was given"
        )
    raise ValueError(
        f"{type(model).__name__} uses sliding-window attention over {window} tokens, and this engine needs the "
        f"whole verifier cache inside that window: {max_columns.explain()} columns > {window}, for the longest "
        "prompt of the batch. Use shorter prompts (speculators eval --max-prompt-tokens) or fewer new tokens "
        "(--max-new-tokens)" + (" or fewer drafted tokens per step" if max_columns.per_step > 1 else "")
    )


def _pick(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(dim=-1)
    return sample(target_probs(logits, temperature, top_p), generator)


class _Outputs:
    """Per-prompt outputs and which rows of the shrinking batch are still running."""

    def __init__(self, batch: int, max_new_tokens: int, eos_token_ids: Iterable[int]) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.accepted: list[list[int]] = [[] for _ in range(batch)]
        self.rows = list(range(batch))  # original index of each active row
        self.max_new_tokens = max_new_tokens
        self.eos = set(eos_token_ids)

    def add(self, emitted: list[list[int]]) -> list[bool]:
        """Append each active row's new tokens (cut at EOS / max_new_tokens); return which rows keep running."""
        keep = []
        for original, new in zip(self.rows, emitted, strict=True):
            out = self.tokens[original]
            done = False
            for token in new:
                out.append(token)
                if token in self.eos or len(out) >= self.max_new_tokens:
                    done = True
                    break
            keep.append(not done)
        return keep


def eos_ids(tokenizer_or_model: object) -> list[int]:
    """EOS ids from a tokenizer or a model's generation config (a list or a single id)."""
    config = getattr(tokenizer_or_model, "generation_config", None)
    value = getattr(config, "eos_token_id", None) if config is not None else None
    if value is None:
        value = getattr(tokenizer_or_model, "eos_token_id", None)
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


# ---- plain decoding -------------------------------------------------------------------------------------------
@torch.inference_mode()
def plain_generate(
    verifier: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_token_ids: Iterable[int] = (),
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Token-by-token decoding with a KV cache: the baseline for identity tests and speedups."""
    start = time.perf_counter()
    width = max((len(p) for p in prompts), default=0)
    columns = CacheColumns(width, max_new_tokens, 1, "1", "1")  # one column per token (and the prefill's)
    runner = VerifierRunner(verifier, len(prompts), max_columns=columns)
    outputs = _Outputs(len(prompts), max_new_tokens, eos_token_ids)
    logits, _, valid = runner.prefill(prompts)
    token = _pick(logits[:, -1], temperature, top_p, generator)
    prefill_s = time.perf_counter() - start
    position = valid.long().sum(dim=1)
    one = torch.ones(len(prompts), 1, 1, dtype=torch.bool, device=runner.device)
    while True:
        keep = torch.tensor(outputs.add([[t] for t in token.tolist()]), device=runner.device)
        if not bool(keep.all()):
            rows = keep.nonzero()[:, 0]
            outputs.rows = [r for r, k in zip(outputs.rows, keep.tolist(), strict=True) if k]
            if not outputs.rows:
                break
            runner.cache.select_rows(rows)
            token, position, one = token[rows], position[rows], one[rows]
        logits = runner.forward(token[:, None], position[:, None], one, one[:, :, 0])
        token = _pick(logits[:, -1], temperature, top_p, generator)
        position = position + 1
    stats = DecodingStats(
        generated=[len(t) for t in outputs.tokens],
        wall_s=time.perf_counter() - start,
        prefill_s=prefill_s,
        verifier_s=runner.seconds,
        verifier_forwards=runner.forwards,
    )
    return GenerationResult(tokens=outputs.tokens, stats=stats)


# ---- speculative decoding -------------------------------------------------------------------------------------
class SpeculativeDecoder:
    """A verifier (HF causal LM) and a draft of any registered algorithm; ``generate`` decodes one batch of
    tokenised prompts. The draft's algorithm unit names the aux layers it reads and how it drafts (sequential
    steps or one block: :mod:`speculators.decoding.drafters`)."""

    def __init__(
        self,
        verifier: nn.Module,
        draft: DraftModel,
        config: DecodingConfig | None = None,
        sampler: RejectionSampler | None = None,
        drafter_factory: Callable[[Sequence[Sequence[int]], torch.device], Any] | None = None,
    ) -> None:
        """``drafter_factory(prompts, device)`` replaces the draft's own drafter for each batch (the oracle of
        :mod:`speculators.decoding.oracle`, which needs the batch's prompts); the draft still names the aux layers."""
        self.verifier = verifier
        self.drafter_factory = drafter_factory
        self.draft = draft.eval()
        self.config = config or DecodingConfig()
        self.sampler = sampler or RejectionSampler()
        self.check(draft, self.config)
        self.drafter_class = drafter_class(draft)
        self.aux_layer_ids = algorithm_of(draft).aux_layer_ids(draft.config)
        verifier_vocab = verifier.get_output_embeddings().weight.shape[0]
        if draft.config.vocab_size != verifier_vocab:
            raise ValueError(
                f"the draft was built for a {draft.config.vocab_size}-token verifier vocabulary but this verifier "
                f"has {verifier_vocab}; pass the verifier the draft was trained against"
            )

    @staticmethod
    def check(draft: DraftModel, config: DecodingConfig) -> None:
        """Refuse what this draft cannot do, before any prefill: trees for block drafters, chains longer than a
        block."""
        name = algorithm_of(draft).name
        drafter = drafter_class(draft)
        if config.method == "tree" and not drafter.supports_tree:
            raise ValueError(
                f"tree drafting is not supported for {name} drafts (one forward proposes one chain): use method "
                "'chain' (speculators eval: drop --tree)"
            )
        most = drafter.max_k(draft.config)
        if config.method == "chain" and most is not None and config.num_speculative_tokens > most:
            raise ValueError(
                f"k={config.num_speculative_tokens} drafts per step, but this {name} draft proposes at most {most} "
                "(its draft slots) in one block"
            )

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        eos_token_ids: Iterable[int] = (),
        generator: torch.Generator | None = None,
    ) -> GenerationResult:
        cfg = self.config
        start = time.perf_counter()
        columns = cfg.max_cache_columns(max((len(p) for p in prompts), default=0))
        runner = VerifierRunner(self.verifier, len(prompts), self.aux_layer_ids, max_columns=columns)
        if self.drafter_factory is not None:
            drafter = self.drafter_factory(prompts, runner.device)
        else:
            drafter = self.drafter_class(self.draft, len(prompts), runner.device)
        outputs = _Outputs(len(prompts), cfg.max_new_tokens, eos_token_ids)
        logits, ids, valid = runner.prefill(prompts)
        root = _pick(logits[:, -1], cfg.temperature, cfg.top_p, generator)
        prefill_s = time.perf_counter() - start
        positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
        segment = Segment(runner.aux, torch.cat([ids[:, 1:], root[:, None]], 1), positions, valid)
        root_position = valid.long().sum(dim=1)
        keep = outputs.add([[t] for t in root.tolist()])
        while True:
            if not all(keep):
                rows = torch.tensor([i for i, k in enumerate(keep) if k], device=runner.device)
                outputs.rows = [r for r, k in zip(outputs.rows, keep, strict=True) if k]
                if not outputs.rows:
                    break
                runner.cache.select_rows(rows)
                drafter.select_rows(rows)
                segment, root, root_position = segment.select_rows(rows), root[rows], root_position[rows]
            tree = self._draft(drafter, segment, root, generator)
            verdict, aux = self._verify(runner, tree, root_position, generator)
            segment = self._commit(runner, tree, verdict, aux, root_position)
            for original, count in zip(outputs.rows, verdict.num_accepted.tolist(), strict=True):
                outputs.accepted[original].append(count)
            keep = outputs.add(verdict.emitted(tree))
            root = verdict.next_token
            root_position = root_position + verdict.num_accepted + 1
        stats = DecodingStats(
            max_depth=cfg.max_depth,
            accepted=outputs.accepted,
            generated=[len(t) for t in outputs.tokens],
            wall_s=time.perf_counter() - start,
            prefill_s=prefill_s,
            verifier_s=runner.seconds,
            draft_s=drafter.seconds,
            verifier_forwards=runner.forwards,
            draft_forwards=drafter.forwards,
        )
        return GenerationResult(tokens=outputs.tokens, stats=stats)

    def _draft(
        self, drafter: Any, segment: Segment, root: torch.Tensor, generator: torch.Generator | None
    ) -> DraftTree:
        cfg = self.config
        if cfg.method == "chain":
            return drafter.chain(
                segment, root, cfg.num_speculative_tokens, cfg.temperature, cfg.top_p, generator
            )
        return drafter.tree(segment, root, cfg.tree_topk, cfg.tree_depth, cfg.tree_budget)

    def _verify(
        self,
        runner: VerifierRunner,
        tree: DraftTree,
        root_position: torch.Tensor,
        generator: torch.Generator | None,
    ) -> tuple[Verdict, torch.Tensor]:
        """One verifier forward over the tree; returns the verdict and the tree's aux states ``[B, N, n_aux*H]``."""
        positions = root_position[:, None] + tree.depths
        valid_new = torch.ones_like(tree.tokens, dtype=torch.bool)
        logits = runner.forward(tree.tokens, positions, tree.ancestor_mask(), valid_new)
        aux = runner.aux
        if self.config.temperature <= 0:
            return verify_greedy(tree, logits), aux
        probs = target_probs(logits, self.config.temperature, self.config.top_p)
        return self.sampler.verify(tree, probs, generator), aux

    @staticmethod
    def _commit(
        runner: VerifierRunner,
        tree: DraftTree,
        verdict: Verdict,
        aux: torch.Tensor,
        root_position: torch.Tensor,
    ) -> Segment:
        """Keep the accepted path in the verifier cache; its positions become the draft's next segment."""
        width = int(verdict.num_accepted.max()) + 1
        path = verdict.path[:, :width]
        keep = torch.arange(width, device=path.device)[None] <= verdict.num_accepted[:, None]
        runner.cache.keep_path(runner.cache.length - tree.num_nodes, path, keep)
        tokens = torch.cat([tree.tokens.gather(1, path[:, 1:]), verdict.next_token[:, None]], dim=1)
        tokens.scatter_(1, verdict.num_accepted[:, None], verdict.next_token[:, None])
        features = aux.gather(1, path[:, :, None].expand(-1, -1, aux.shape[-1]))
        positions = root_position[:, None] + torch.arange(width, device=path.device)[None]
        return Segment(features, tokens, positions, keep)
