"""The ``vllm`` capture back end (vLLM's own ``extract_hidden_states`` + hidden-states connector, run in the vLLM
virtualenv) against the ``transformers`` one: the same features for the same layer ids, in fp32, on SmolLM2; a
control one layer off is caught; and a whole ``data_gen.capture.backend=vllm`` run writes shards that verify and
train."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from data_gen.capture import resolve_aux_layer_ids
from data_gen.capture_backends import CaptureSettings, TransformersCapture
from data_gen.masks import ChatMasker
from data_gen.pipeline import run_data_gen
from data_gen.sources import Conversation
from data_gen.store import FeatureDataset
from tests.conftest import require_consumer
from tests.train.conftest import compose
from train.trainer import train

# fp32 in both engines; vLLM's CPU kernels (its own GEMMs, attention and fused RMSNorm) round differently from
# torch's, over 30 layers. Measured worst per-token relative error at the same layer 1e-6 to 6e-6 (ids 2, 15, 27
# and L); the closest neighbouring layer differs by 0.42 to 0.86, so a ±1 mistake cannot pass.
RELATIVE_TOLERANCE = 1e-3
NUM_LAYERS = 30  # SmolLM2-135M


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Worst per-token error, relative to that token's state norm (residual streams grow with depth)."""
    return float(((a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1).clamp_min(1e-6)).max())


def smollm2_sequences(tokenizer) -> list[list[int]]:
    masker = ChatMasker(tokenizer)
    chats = [
        ("What is the capital of France?", "The capital of France is Paris."),
        ("Name three prime numbers.", "Two, three and five are prime numbers."),
        ("Write one line about the sea.", "The sea keeps its secrets under grey, patient waves."),
        ("How many legs has a spider?", "A spider has eight legs."),
    ]
    sequences = []
    for i, (question, answer) in enumerate(chats):
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        (sample,) = masker.encode(Conversation(f"c{i}", messages), 256, "truncate")
        sequences.append(list(sample.input_ids))
    return sequences


@pytest.fixture(scope="module")
def both_captures(smollm2_dir, smollm2_tokenizer):
    """SmolLM2 in fp32 through both back ends. vLLM captures every default id AND its two neighbours in one engine
    run, so the ±1 control costs no second engine."""
    from data_gen.vllm_capture import VllmCapture
    from speculators.serving.vllm_bridge import vllm_available
    from speculators.verifier import load_verifier

    require_consumer(vllm_available(), "the vLLM virtualenv", "vllm-env")
    default = resolve_aux_layer_ids(None, NUM_LAYERS)
    widened = sorted({k + d for k in default for d in (-1, 0, 1)})
    sequences = smollm2_sequences(smollm2_tokenizer)
    model, _ = load_verifier(str(smollm2_dir), torch.float32, torch.device("cpu"))
    hf = TransformersCapture(model, default, batch_size=4, pad_id=smollm2_tokenizer.pad_token_id or 0)
    hf_features = hf.capture(sequences)
    vllm = VllmCapture(str(smollm2_dir), widened, NUM_LAYERS, "float32", 256, CaptureSettings(threads=1))
    try:
        vllm_features = vllm.capture(sequences)
    finally:
        vllm.close()
    return default, widened, hf_features, vllm_features


def column(features: tuple[torch.Tensor, torch.Tensor], ids: list[int], layer: int) -> torch.Tensor:
    """The residual stream of ``layer`` out of an ``aux_hidden`` [T, n*H] captured for ``ids``."""
    aux = features[0]
    width = aux.shape[-1] // len(ids)
    index = ids.index(layer)
    return aux[:, index * width : (index + 1) * width]


@pytest.mark.consumer
@pytest.mark.slow  # one vLLM engine (SmolLM2, fp32) in its own virtualenv, shared with the control below
def test_vllm_features_equal_the_hf_capture_at_the_same_layer_ids(both_captures):
    default, widened, hf_features, vllm_features = both_captures
    assert len(vllm_features) == len(hf_features) == 4
    for hf, vllm in zip(hf_features, vllm_features, strict=True):
        assert vllm[0].dtype == torch.float32 and vllm[0].shape[0] == hf[0].shape[0]
        for layer in default:
            assert (
                relative_error(column(vllm, widened, layer), column(hf, default, layer)) < RELATIVE_TOLERANCE
            )
        assert relative_error(vllm[1], hf[1]) < RELATIVE_TOLERANCE  # last layer, before the final norm


@pytest.mark.consumer
@pytest.mark.slow
def test_a_capture_one_layer_off_fails_the_equality(both_captures):
    """The control: had either back end shifted its ids by one (the ±1 trap), the equality above would fail."""
    default, widened, hf_features, vllm_features = both_captures
    for hf, vllm in zip(hf_features, vllm_features, strict=True):
        for layer in default:
            for off in (layer - 1, layer + 1):
                assert (
                    relative_error(column(vllm, widened, off), column(hf, default, layer))
                    > 50 * RELATIVE_TOLERANCE
                )


def first_train_record(run_dir) -> dict:
    return next(json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())


@pytest.mark.consumer
@pytest.mark.slow  # one vLLM engine (the tiny verifier), two tiny data_gen runs, one tiny training epoch
def test_data_gen_with_the_vllm_backend_writes_verified_shards_that_train(tiny_llama_dir, tmp_path):
    """``data_gen.capture.backend=vllm`` through the recipe: the shards pass the store's verification, hold the
    same ids, masks and (bf16) features as the transformers back end's, and a draft trains on them."""
    from speculators.serving.vllm_bridge import vllm_available

    require_consumer(vllm_available(), "the vLLM virtualenv", "vllm-env")
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"chat-{i}",
                    "messages": [
                        {"role": "user", "content": f"Tell me fact number {i} about {topic}."},
                        {"role": "assistant", "content": f"Fact {i}: {topic} are older than they look."},
                    ],
                }
            )
            + "\n"
            for i, topic in enumerate(["rivers", "bread", "stars", "chess", "tides", "bees"])
        )
    )
    common = [
        "recipe=tiny_eagle3",
        f"verifier.name_or_path={tiny_llama_dir}",
        f"data.source={chats}",
        "data.heldout_fraction=0.0",
        "data.max_length=64",
        "train.max_length=64",
        "train.epochs=1",
        "train.micro_batch_size=6",
        "model.draft_vocab_size=null",
        "logging=disabled",
        "data_gen.capture.threads=1",
    ]
    runs = {}
    for backend in ("vllm", "transformers"):
        cfg = compose(
            [
                *common,
                f"run_dir={tmp_path / backend}",
                f"data_gen.output_dir={tmp_path / backend / 'data'}",
                f"data_gen.capture.backend={backend}",
            ]
        )
        run_data_gen(OmegaConf.to_container(cfg, resolve=True))
        runs[backend] = cfg
    vllm_data, hf_data = (
        FeatureDataset(tmp_path / "vllm/data/train"),
        FeatureDataset(tmp_path / "transformers/data/train"),
    )
    vllm_data.verify_shards()
    assert vllm_data.manifest["verifier"]["capture_backend"] == "vllm"
    assert vllm_data.manifest["aux_layer_ids"] == hf_data.manifest["aux_layer_ids"]
    assert len(vllm_data) == len(hf_data) == 6
    for i in range(len(hf_data)):
        ours, theirs = vllm_data[i], hf_data[i]
        assert ours["sample_id"] == theirs["sample_id"]
        assert torch.equal(ours["input_ids"], theirs["input_ids"])
        assert torch.equal(ours["loss_mask"], theirs["loss_mask"])
        assert relative_error(ours["aux_hidden"], theirs["aux_hidden"]) < 2e-2  # both stored in bf16
        assert relative_error(ours["last_hidden"], theirs["last_hidden"]) < 2e-2
    train(runs["vllm"], tmp_path / "vllm")
    record = first_train_record(tmp_path / "vllm")
    assert record["tokens"] > 0 and torch.isfinite(torch.tensor(record["train/loss"]))
    assert (tmp_path / "vllm" / "checkpoints" / "step-1" / "draft" / "model.safetensors").is_file()


def test_an_unknown_capture_backend_is_refused_naming_the_choices():
    from data_gen.pipeline import GenSettings

    with pytest.raises(
        ValueError, match=r"data_gen.capture.backend='sglang'; use one of \['transformers', 'vllm'\]"
    ):
        GenSettings.from_mapping({"capture": {"backend": "sglang"}})
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        GenSettings.from_mapping({"capture": {"backend": "vllm", "tensor_parallel_size": 0}})


def test_the_vllm_backend_without_its_virtualenv_says_so_and_writes_nothing(
    tiny_llama_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("SPECULATORS_VLLM_PYTHON", str(tmp_path / "no-such-venv" / "python"))
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        json.dumps(
            {
                "id": "a",
                "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
            }
        )
        + "\n"
    )
    out = tmp_path / "data"
    cfg = compose(
        [
            "recipe=tiny_eagle3",
            f"verifier.name_or_path={tiny_llama_dir}",
            f"data.source={chats}",
            f"data_gen.output_dir={out}",
            "data_gen.capture.backend=vllm",
        ]
    )
    with pytest.raises(
        RuntimeError, match="capture.backend=vllm is not available.*make vllm-env.*backend=transformers"
    ):
        run_data_gen(OmegaConf.to_container(cfg, resolve=True))
    assert not out.exists()
