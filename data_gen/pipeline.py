"""The data-generation run: conversations → (regenerate) → masks → verifier features → shards, resumable.

The unit of work is a SHARD: shard k of a split holds conversations ``[k*shard_size, (k+1)*shard_size)`` of that
split (in source order), and rank r processes the shards with ``k % world_size == r``. Because a shard's content
depends only on the data and the settings, the output is the same for any number of processes, and a killed run
resumes by skipping the shards already written (see ``data_gen.store``). Rank 0 alone writes the shared files:
``run_identity.json`` and ``heldout_conversations.jsonl`` before the work, the manifests, ``token_counts.safetensors``
and ``summary.json`` after it.

Every check that can refuse the run (source, chat template, aux layer ids, output directory of another verifier)
happens before anything is written, on every rank, so a refused run leaves nothing behind and no rank waits on
another that failed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from data_gen.capture import LAYER_CONVENTION, resolve_aux_layer_ids, verifier_fingerprint
from data_gen.capture_backends import (
    CaptureBackend,
    CaptureSettings,
    VerifierHandle,
    backend_needs_verifier_on_device,
    build_capture_backend,
)
from data_gen.masks import ChatMasker, EncodedSample, MaskingError
from data_gen.regenerate import RegenerateSettings, Regenerator, VllmGenerator, transformers_generate
from data_gen.sources import (
    MAX_EXAMPLES,
    Conversation,
    DataSettings,
    load_conversations,
    split_source,
)
from data_gen.stats import count_assistant_tokens, write_token_counts
from data_gen.store import (
    FORMAT_VERSION,
    HELDOUT_CONVERSATIONS_NAME,
    SPLITS,
    STORAGE_DTYPES,
    Sample,
    check_or_write_identity,
    done_record,
    finalize_split,
    remove_stale_temporaries,
    write_shard,
)
from speculators import families
from speculators.atomic import atomic_write_json, atomic_write_text
from speculators.head_check import PROBE_NAME, HeadProbe, record_head_probe
from speculators.precision import Precision, choose
from speculators.verifier import load_verifier, resolve_verifier_path
from speculators.vocab import tokenizer_fingerprint

log = logging.getLogger("data_gen")


@dataclass
class GenSettings:
    """The ``data_gen`` section of the recipe (see recipes/data_gen/default.yaml)."""

    output_dir: str = "outputs/data"
    batch_size: int = 8
    shard_size: int = 64
    storage_dtype: str = "bfloat16"
    verify_resumed_shards: bool = True
    barrier_timeout_hours: float = 24.0
    regenerate: RegenerateSettings = field(default_factory=RegenerateSettings)
    capture: CaptureSettings = field(default_factory=CaptureSettings)

    @classmethod
    def from_mapping(cls, mapping: dict[str, Any]) -> GenSettings:
        mapping = dict(mapping)
        regenerate = RegenerateSettings(**(mapping.pop("regenerate", None) or {}))
        capture = CaptureSettings(**(mapping.pop("capture", None) or {}))
        unknown = sorted(set(mapping) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"unknown data_gen settings {unknown}; known: {sorted(cls.__dataclass_fields__)}"
            )
        settings = cls(**mapping, regenerate=regenerate, capture=capture)
        if settings.storage_dtype not in STORAGE_DTYPES:
            raise ValueError(
                f"data_gen.storage_dtype={settings.storage_dtype!r}; use one of {sorted(STORAGE_DTYPES)}"
            )
        if settings.batch_size < 1 or settings.shard_size < 1:
            raise ValueError("data_gen.batch_size and data_gen.shard_size must be at least 1")
        if settings.barrier_timeout_hours <= 0:
            raise ValueError(
                f"data_gen.barrier_timeout_hours={settings.barrier_timeout_hours}; use a positive number of hours "
                "(longer than the slowest rank's share of the run)"
            )
        settings.regenerate.check()
        settings.capture.check()
        return settings


@dataclass
class Distributed:
    """Who this process is (accelerate fills it in run.py; a plain call is one process on CPU)."""

    rank: int = 0
    world_size: int = 1
    device: str | torch.device = "cpu"
    barrier: Callable[[], None] = lambda: None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass
class Prepared:
    """Everything the shard loop needs, built (and checked) before anything is written."""

    data: DataSettings
    gen: GenSettings
    verifier_path: str
    splits: dict[str, list[Conversation]]
    source_report: dict[str, Any]
    masker: ChatMasker
    capture: CaptureBackend
    identity: dict[str, Any]
    header: dict[str, Any]
    tokenizer: Any
    regenerator: Regenerator | None
    head_probe: HeadProbe | None = None  # rank 0: the verifier's own logits, for the trainer's head check


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class VerifierSide:
    """The verifier, its tokenizer and chat masker, and the aux layers captured from it."""

    path: str  # resolved local directory or hub id
    hf_config: Any
    tokenizer: Any
    masker: ChatMasker
    model: Any
    aux_layer_ids: list[int]
    capture: CaptureBackend
    precision: Precision  # the capture dtype and why (recorded in every manifest and the summary)


def prepare(config: dict[str, Any], dist: Distributed) -> Prepared:
    """Load and check everything (source, template, layer ids, verifier, output dir); writes nothing."""
    data = DataSettings.from_mapping(config["data"])
    gen = GenSettings.from_mapping(config["data_gen"])
    verifier = dict(config["verifier"])
    check_output_dir(gen.output_dir)
    name = str(verifier["name_or_path"])  # whose traffic a served log must be
    conversations, report = load_conversations(data, verifier=name, regenerate=gen.regenerate.enabled)
    train, heldout = split_source(conversations, data, report)
    log.info("%s; train %d, heldout %d", report.summary(), len(train), len(heldout))
    side = load_verifier_side(verifier, data, torch.device(dist.device), gen)
    identity = run_identity(side, data, gen)
    regenerator = build_regenerator(gen.regenerate, data, side.masker, side.model, side.tokenizer, side.path)
    check_or_write_identity(gen.output_dir, identity, write=False)
    serving = families.vllm_serving_note(side.hf_config)
    if serving and dist.is_main:
        log.warning(serving)
    return Prepared(
        data=data,
        gen=gen,
        verifier_path=side.path,
        splits={"train": train, "heldout": heldout},
        source_report=report.to_json(),
        masker=side.masker,
        capture=side.capture,
        identity=identity,
        header=shard_header(side, name, identity, data, report.to_json()),
        tokenizer=side.tokenizer,
        regenerator=regenerator,
        head_probe=first_head_probe(side, train, data) if dist.is_main else None,
    )


def check_output_dir(output_dir: str | Path) -> None:
    """Refuse, before anything is written, an output directory that cannot be made because a file stands where
    it or one of its parents must be (``mkdir`` would stop the run later with a bare "Not a directory")."""
    path = Path(output_dir).expanduser().absolute()
    for candidate in (path, *path.parents):
        if candidate.exists():
            if not candidate.is_dir():
                raise NotADirectoryError(
                    f"data_gen.output_dir={output_dir}: {candidate} is a file, not a directory; choose another "
                    "data_gen.output_dir (or move that file)"
                )
            return


def first_head_probe(side: VerifierSide, conversations: list[Conversation], data: DataSettings) -> HeadProbe:
    """The verifier's own log-probabilities on the first training conversation that encodes
    (speculators.head_check): written beside the features, where the trainer checks its head against them."""
    drops: Counter = Counter()
    examples: dict[str, list[str]] = {}
    for conversation in conversations:
        encoded, counts = encode_conversations(side.masker, [conversation], data, examples)
        if encoded:
            return record_head_probe(side.model, encoded[0].input_ids)
        drops.update(counts)
    reasons = ", ".join(f"{k.removeprefix('dropped_')}={v}" for k, v in sorted(drops.items())) or "none"
    first = next((found[0] for found in examples.values() if found), "")
    raise ValueError(
        f"no training conversation of {data.source} could be masked (dropped: {reasons}; e.g. {first}); nothing "
        f"to train on: fix what the example says (overlong, no_loss_tokens: raise data.max_length={data.max_length})"
    )


def load_verifier_side(
    verifier: dict[str, Any], data: DataSettings, device: torch.device, gen: GenSettings
) -> VerifierSide:
    """Tokenizer and chat masker (the template is checked here), the aux layer ids, the verifier itself (on
    ``device``, or on the CPU while it waits for regeneration or serves no forward: see
    :func:`verifier_waits_on_cpu`), then the capture back end."""
    from transformers import AutoConfig, AutoTokenizer

    path = resolve_verifier_path(str(verifier["name_or_path"]))
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf_config = AutoConfig.from_pretrained(path)
    family = families.of_config(hf_config)  # layout, layer count and chat format of a wrapper (text_config)
    masker = ChatMasker(tokenizer, data.turn_mode, data.chat_template, family.chat)
    text = family.flat_config(hf_config.to_dict())
    aux_ids = resolve_aux_layer_ids(verifier.get("aux_layer_ids"), int(text["num_hidden_layers"]))
    # vLLM regeneration owns the GPU while it runs: the HF verifier waits on the CPU (in its GPU dtype) until then
    precision = choose(verifier.get("dtype", "auto"), device, key="verifier.dtype")
    model, _ = load_verifier(
        path, precision.dtype, torch.device("cpu") if verifier_waits_on_cpu(gen) else device
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else masker.eot_id
    handle = VerifierHandle(
        model, path, aux_ids, int(text["num_hidden_layers"]), pad_id, gen.batch_size, data.max_length
    )
    vocab_size = int(text["vocab_size"])
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the verifier's vocab_size is {vocab_size}; "
            "they do not belong together"
        )
    capture = build_capture_backend(gen.capture, handle)
    return VerifierSide(path, hf_config, tokenizer, masker, model, aux_ids, capture, precision)


def run_identity(side: VerifierSide, data: DataSettings, gen: GenSettings) -> dict[str, Any]:
    """Who made this data: a rerun into the same output directory must match it exactly (``run_identity.json``)."""
    return {
        "format_version": FORMAT_VERSION,
        "verifier": {
            "fingerprint": verifier_fingerprint(side.model),
            "architectures": list(getattr(side.hf_config, "architectures", None) or []),
        },
        "tokenizer": {
            "fingerprint": tokenizer_fingerprint(side.tokenizer),
            "chat_template_sha256": _sha256_text(side.masker.template),
            "masking": {k: v for k, v in side.masker.describe().items() if k != "prefix_stable"},
        },
        "aux_layer_ids": side.aux_layer_ids,
        "layer_convention": LAYER_CONVENTION,
        "capture_dtype": side.precision.name,  # fp32 and bf16 captures differ: never mixed in one directory
        "storage_dtype": gen.storage_dtype,
        "shard_size": gen.shard_size,
        "data": _data_identity(data),
        "regenerate": _regenerate_identity(gen.regenerate),
    }


def shard_header(
    side: VerifierSide,
    name_or_path: str,
    identity: dict[str, Any],
    data: DataSettings,
    report: dict[str, Any],
) -> dict[str, Any]:
    """What every split's manifest records about the features (the trainer's contract, see ``data_gen.store``)."""
    text = families.flat_config(side.hf_config.to_dict())
    return {
        "aux_layer_ids": side.aux_layer_ids,
        "layer_convention": LAYER_CONVENTION,
        # read via the family: a wrapper (Gemma 4, Mistral 3) keeps them in text_config
        "num_hidden_layers": int(text["num_hidden_layers"]),
        "hidden_size": int(text["hidden_size"]),
        "vocab_size": int(text["vocab_size"]),
        "storage_dtype": identity["storage_dtype"],
        "verifier": {
            "name_or_path": name_or_path,
            "resolved_path": side.path,
            "architectures": identity["verifier"]["architectures"],
            "fingerprint": identity["verifier"]["fingerprint"],
            "capture_dtype": str(next(side.model.parameters()).dtype).replace("torch.", ""),
            "capture_backend": side.capture.name,
            "precision": side.precision.to_json(),
        },
        "tokenizer": {**identity["tokenizer"], **side.masker.describe()},
        "data": {"settings": asdict(data), "source_report": report},
        "regenerate": identity["regenerate"],
    }


def verifier_waits_on_cpu(gen: GenSettings) -> bool:
    """Whether the HF verifier is loaded on the CPU: while a vLLM regeneration worker owns the GPU (it moves to
    the device afterwards, if the capture back end runs it), or for good when nothing here runs it (vLLM capture
    without transformers regeneration: it then only gives the run's fingerprint and dtype)."""
    runs_here = backend_needs_verifier_on_device(gen.capture) or (
        gen.regenerate.enabled and gen.regenerate.backend in ("transformers", "engine")
    )
    return regenerates_first(gen.regenerate) or not runs_here


def regenerates_first(settings: RegenerateSettings) -> bool:
    """Whether every pending shard is regenerated before any capture: the vLLM back-end runs a worker that takes
    most of the rank's GPU, so the HF verifier is moved there only after the worker has exited. The engine
    back-end decodes with the HF verifier itself, in this process, so it regenerates shard by shard like
    ``transformers``."""
    return settings.enabled and settings.backend == "vllm"


def build_regenerator(
    settings: RegenerateSettings,
    data: DataSettings,
    masker: ChatMasker,
    model: Any,
    tokenizer: Any,
    path: str,
) -> Regenerator | None:
    """The regeneration stage when the recipe enables it (its back-end is checked here, before any write). The
    engine back-end loads its draft here (a draft that cannot serve ``k`` is refused now) and tells the masker how
    much a rejected token weighs (``masker.replay_weight``)."""
    if not settings.enabled:
        return None
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stop_ids = sorted({masker.eot_id, *eos})
    if settings.backend == "vllm":
        dtype = str(next(model.parameters()).dtype).replace("torch.", "")
        generate = VllmGenerator(path, settings, dtype, data.max_length + settings.max_new_tokens)
    elif settings.backend == "engine":
        from data_gen.regenerate import engine_generate, load_engine_draft

        draft = load_engine_draft(str(settings.draft), model)
        generate = engine_generate(model, draft, tokenizer, settings, stop_ids)
        masker.replay_weight = settings.replay_weight
    else:
        generate = transformers_generate(model, tokenizer, settings, stop_ids)
    return Regenerator(generate, masker, settings, data.max_length, data.seed)


def _data_identity(data: DataSettings) -> dict[str, Any]:
    settings = asdict(data)
    source = Path(str(data.source)).expanduser()
    if source.is_file():
        settings["source_bytes"] = source.stat().st_size
    return settings


def _regenerate_identity(settings: RegenerateSettings) -> dict[str, Any]:
    """What regeneration makes the data depend on. The engine back-end adds its draft (by content), ``k`` and
    ``replay_weight``: another draft or chain length rejects other tokens, another weight weighs them otherwise,
    so a resume with any of them changed is refused. The other back-ends give the same answers and are not named
    (a run may resume with the other one)."""
    if not settings.enabled:
        return {"enabled": False}
    identity: dict[str, Any] = {
        "enabled": True,
        "temperature": settings.temperature,
        "max_new_tokens": settings.max_new_tokens,
    }
    if settings.backend == "engine":
        from data_gen.regenerate import draft_fingerprint

        identity["engine"] = {
            "draft_sha256": draft_fingerprint(str(settings.draft)),
            "k": settings.k,
            "replay_weight": settings.replay_weight,
        }
    return identity


# ---- one shard ----------------------------------------------------------------------------------------------
def capture_samples(capture: CaptureBackend, encoded: list[EncodedSample]) -> list[Sample]:
    """The features of ``encoded`` from the capture back end, as samples in the input order (ids, loss masks and
    error-replay loss weights are the pipeline's own: no back end tokenizes)."""
    features = capture.capture([sample.input_ids for sample in encoded])
    weights = [
        None if s.loss_weight is None else torch.tensor(s.loss_weight, dtype=torch.float32) for s in encoded
    ]
    return [
        Sample(
            sample_id=sample.sample_id,
            input_ids=torch.tensor(sample.input_ids, dtype=torch.long),
            loss_mask=torch.tensor(sample.loss_mask, dtype=torch.bool),
            aux_hidden=aux,
            last_hidden=last,
            loss_weight=weight,
        )
        for sample, (aux, last), weight in zip(encoded, features, weights, strict=True)
    ]


def encode_conversations(
    masker: ChatMasker,
    conversations: list[Conversation],
    data: DataSettings,
    examples: dict[str, list[str]] | None = None,
) -> tuple[list[EncodedSample], Counter]:
    """The samples of ``conversations`` and the counts of what was dropped (``dropped_<reason>``) or truncated.

    A conversation that cannot be masked, or that the chat template refuses (a strict template's "roles must
    alternate"), is dropped and counted, never the run; ``examples`` collects the first few messages per reason,
    for the report."""
    encoded: list[EncodedSample] = []
    counts: Counter = Counter()
    for conversation in conversations:
        try:
            samples = masker.encode(conversation, data.max_length, data.overlong)
        except MaskingError as problem:
            counts[f"dropped_{problem.reason}"] += 1
            if examples is not None:
                add_example(examples, problem.reason, str(problem))
            continue
        counts["truncated"] += sum(s.truncated for s in samples)
        encoded += samples
    return encoded, counts


def add_example(examples: dict[str, list[str]], reason: str, message: str) -> None:
    """Keep ``message`` as an example of ``reason`` while fewer than :data:`MAX_EXAMPLES` are kept."""
    kept = examples.setdefault(reason, [])
    if len(kept) < MAX_EXAMPLES:
        kept.append(message)


def encode_recipe_conversations(
    data: dict[str, Any], tokenizer: Any, chat: families.ChatFormat, verifier: str | None = None
) -> tuple[list[EncodedSample], list[EncodedSample]]:
    """The recipe's conversations (its ``data`` group) split and masked as a data_gen run masks them: the train and
    held-out samples of the trainers and capture producers that encode for themselves (online, streamed).

    ``chat`` is the verifier family's chat format (``families.of_config(config).chat``) and has no default on
    purpose: without it the masker probes the end of turn itself, which refuses some families' templates (Mistral
    3) and ends others' turns too early (gpt-oss at ``<|channel|>``), so the loss masks would differ from the
    offline ones.

    ``verifier`` is the recipe's ``verifier.name_or_path``, whose traffic a served log must be (default: the
    tokenizer's ``name_or_path``). Streamed modes refuse regeneration, so a log's bare prompts are refused here."""
    settings = DataSettings.from_mapping(dict(data))
    name = verifier if verifier is not None else getattr(tokenizer, "name_or_path", None)
    conversations, report = load_conversations(settings, verifier=name or None, regenerate=False)
    train, heldout = split_source(conversations, settings, report)
    masker = ChatMasker(tokenizer, settings.turn_mode, settings.chat_template, chat)
    return (
        encode_conversations(masker, train, settings)[0],
        encode_conversations(masker, heldout, settings)[0],
    )


class ShardWorker:
    """Builds the shards of one rank."""

    def __init__(self, prepared: Prepared, dist: Distributed) -> None:
        self.p = prepared
        self.dist = dist
        self.out = Path(prepared.gen.output_dir)
        self.regenerator = prepared.regenerator

    def shard(
        self,
        split: str,
        index: int,
        conversations: list[Conversation],
        progress: Callable[[int], None] | None = None,
    ) -> dict[str, Any]:
        """Regenerate (optional), mask, capture and write one shard; ``progress(n)`` after each regenerated batch."""
        counts: Counter = Counter()
        if self.regenerator is not None:
            conversations, regen_counts = self.regenerate(split, index, conversations, progress)
            counts.update({f"regenerate_{k}": v for k, v in regen_counts.items()})
        examples: dict[str, list[str]] = {}
        encoded, mask_counts = encode_conversations(self.p.masker, conversations, self.p.data, examples)
        counts.update(mask_counts)
        samples = capture_samples(self.p.capture, encoded)
        num_aux = len(self.p.capture.aux_layer_ids)
        extra: dict[str, Any] = {"conversations": len(conversations), "counts": dict(counts)}
        if examples:  # why conversations were dropped, in the words of the masker or the template
            extra["drop_examples"] = examples
        return write_shard(self.out / split, index, samples, num_aux, self.p.gen.storage_dtype, extra)

    def regenerate(
        self,
        split: str,
        index: int,
        conversations: list[Conversation],
        progress: Callable[[int], None] | None = None,
    ) -> tuple[list[Conversation], Counter]:
        """Regenerated conversations of one shard, through its resumable cache (cached batches cost nothing)."""
        cache = self.out / "regenerated" / split / f"shard-{index:05d}.jsonl"
        return self.regenerator.regenerate(conversations, cache, progress)


# ---- the run ------------------------------------------------------------------------------------------------
def shard_plan(splits: dict[str, list[Conversation]], shard_size: int) -> dict[str, int]:
    return {split: (len(convs) + shard_size - 1) // shard_size for split, convs in splits.items()}


def run_data_gen(
    config: dict[str, Any],
    dist: Distributed | None = None,
    on_shard: Callable[[str, int, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Generate (or resume) the features described by ``config`` (the resolved recipe as a dict).

    ``on_shard(split, index, record)`` is called after each shard this rank writes (progress hooks; a test uses
    it to stop a run part-way). Returns the summary (rank 0: of the whole output; other ranks: of their work).
    """
    from tqdm.auto import tqdm

    dist = dist or Distributed()
    started = time.time()
    prepared = prepare(config, dist)
    out = Path(prepared.gen.output_dir)
    plan = shard_plan(prepared.splits, prepared.gen.shard_size)
    if dist.is_main:
        out.mkdir(parents=True, exist_ok=True)
        check_or_write_identity(out, prepared.identity, write=True)
        for directory in (out, *(out / split for split in SPLITS)):
            remove_stale_temporaries(directory)
        heldout_lines = "".join(
            json.dumps(c.to_json(), ensure_ascii=False) + "\n" for c in prepared.splits["heldout"]
        )
        atomic_write_text(out / HELDOUT_CONVERSATIONS_NAME, heldout_lines)
        atomic_write_json(out / "recipe.json", config)
        if prepared.head_probe is not None:
            prepared.head_probe.save(out / PROBE_NAME)
    dist.barrier()

    size = prepared.gen.shard_size
    mine = [(split, k) for split in SPLITS for k in range(plan[split]) if k % dist.world_size == dist.rank]
    pending, resumed = [], 0
    for split, k in mine:
        if done_record(out / split, k, verify=prepared.gen.verify_resumed_shards) is None:
            pending.append((split, k))
        else:
            resumed += 1
    if resumed:
        log.info("rank %d: resuming, %d of %d shards already done", dist.rank, resumed, len(mine))
    worker = ShardWorker(prepared, dist)
    total = sum(len(prepared.splits[s][k * size : (k + 1) * size]) for s, k in pending)
    tokens = 0
    work_started = time.time()
    quiet = not dist.is_main
    regenerating = prepared.regenerator is not None
    with (
        tqdm(
            total=total, unit="conv", desc="regenerate", disable=quiet or not regenerating, position=1
        ) as regen,
        tqdm(total=total, unit="conv", desc=f"data_gen rank {dist.rank}", disable=quiet, position=0) as bar,
    ):
        try:
            if regenerates_first(prepared.gen.regenerate):
                for split, k in pending:  # into the caches; the shard loop below reads them back
                    worker.regenerate(
                        split, k, prepared.splits[split][k * size : (k + 1) * size], regen.update
                    )
                prepared.regenerator.close()  # the vLLM worker exits and frees the GPU
                prepared.capture.move_to(dist.device)
            for split, k in pending:
                conversations = prepared.splits[split][k * size : (k + 1) * size]
                record = worker.shard(split, k, conversations, regen.update)
                tokens += record["num_tokens"]
                bar.update(len(conversations))
                bar.set_postfix(tok_s=f"{tokens / max(time.time() - work_started, 1e-9):.0f}", split=split)
                if on_shard is not None:
                    on_shard(split, k, record)
        finally:
            if prepared.regenerator is not None:
                prepared.regenerator.close()
            prepared.capture.close()
    dist.barrier()
    if not dist.is_main:
        return {"rank": dist.rank, "shards": len(pending), "tokens": tokens, "seconds": time.time() - started}
    return finalize(prepared, plan, started, tokens)


def finalize(prepared: Prepared, plan: dict[str, int], started: float, new_tokens: int) -> dict[str, Any]:
    """Rank 0: manifests, token counts and the summary."""
    out = Path(prepared.gen.output_dir)
    manifests = {split: finalize_split(out / split, plan[split], prepared.header) for split in SPLITS}
    vocab_size = prepared.header["vocab_size"]
    counts = count_assistant_tokens(out / "train", vocab_size)
    provenance = {
        "tokenizer_fingerprint": prepared.identity["tokenizer"]["fingerprint"],
        "verifier_fingerprint": prepared.identity["verifier"]["fingerprint"],
        "verifier": prepared.header["verifier"]["name_or_path"],
        "vocab_size": vocab_size,
        "split": "train",
        "num_samples": manifests["train"]["num_samples"],
        "num_loss_tokens": manifests["train"]["num_loss_tokens"],
        "data": prepared.identity["data"],
        "regenerate": prepared.identity["regenerate"],
    }
    write_token_counts(out, counts, provenance)
    elapsed = time.time() - started
    totals: Counter = Counter()
    examples: dict[str, list[str]] = {}
    for manifest in manifests.values():
        for shard in manifest["shards"]:
            totals.update(shard.get("counts", {}))
            for reason, messages in shard.get("drop_examples", {}).items():
                for message in messages:
                    add_example(examples, reason, message)
    tokens = sum(m["num_tokens"] for m in manifests.values())
    size = sum(m["bytes"] for m in manifests.values())
    hidden = prepared.header["hidden_size"]
    summary = {
        "output_dir": str(out),
        "samples": {s: m["num_samples"] for s, m in manifests.items()},
        "conversations": {s: len(c) for s, c in prepared.splits.items()},
        "tokens": tokens,
        "loss_tokens": sum(m["num_loss_tokens"] for m in manifests.values()),
        "bytes": size,
        "bytes_per_token": size / max(tokens, 1),
        "naive_bytes_per_token": 4 * hidden * 2,
        "storage_dtype": prepared.gen.storage_dtype,
        "capture_precision": prepared.header["verifier"]["precision"],
        "seconds": elapsed,
        "tokens_captured_now": new_tokens,
        "tokens_per_second_now": new_tokens / max(elapsed, 1e-9),
        "source": prepared.source_report,
        "counts": dict(totals),
        "drop_examples": examples,
    }
    atomic_write_json(out / "summary.json", summary)
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    """A few human lines for the end of a run."""
    if "samples" not in summary:
        return f"rank {summary['rank']}: {summary['shards']} shards, {summary['tokens']} tokens"
    dropped = {k: v for k, v in summary["counts"].items() if "dropped_" in k or k == "truncated"}
    source_dropped = summary["source"]["dropped"]
    examples = [f"  e.g. {reason}: {found[0]}" for reason, found in summary.get("drop_examples", {}).items()]
    return "\n".join(
        [
            f"data_gen done → {summary['output_dir']}",
            f"  samples: train {summary['samples']['train']}, heldout {summary['samples']['heldout']}"
            f" (from {summary['conversations']['train']} + {summary['conversations']['heldout']} conversations)",
            f"  tokens: {summary['tokens']:,} ({summary['loss_tokens']:,} assistant)",
            f"  bytes: {summary['bytes']:,} = {summary['bytes_per_token']:.0f} B/token ({summary['storage_dtype']};"
            f" naive 4×H×2 = {summary['naive_bytes_per_token']} B/token)",
            f"  time: {summary['seconds']:.1f} s, {summary['tokens_per_second_now']:.0f} tokens/s captured this run"
            f" (verifier in {summary['capture_precision']['dtype']}: {summary['capture_precision']['reason']})",
            f"  source drops: {source_dropped or 'none'}; masking: {dropped or 'none'}",
            *examples,
        ]
    )


__all__ = [
    "Distributed",
    "GenSettings",
    "capture_samples",
    "encode_conversations",
    "encode_recipe_conversations",
    "format_summary",
    "prepare",
    "run_data_gen",
]
