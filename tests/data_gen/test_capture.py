"""The capture's layer ids against the verifier's own forward (vLLM's convention, the ±1 trap)."""

from __future__ import annotations

import pytest
import torch

from data_gen.capture import FeatureCapture, verifier_fingerprint
from speculators.format.config import default_aux_layer_ids


@pytest.fixture(scope="module")
def tiny_llama(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (2, 9), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding
    return ids, mask


def test_aux_id_k_is_the_residual_stream_entering_layer_k(tiny_llama):
    num_layers = tiny_llama.config.num_hidden_layers
    ids, mask = batch()
    layer_ids = list(range(num_layers + 1))
    out = FeatureCapture(tiny_llama, layer_ids).capture(ids, mask)
    with torch.no_grad():
        reference = tiny_llama(ids, attention_mask=mask, output_hidden_states=True)
    hidden = tiny_llama.config.hidden_size
    real = mask.bool()
    assert out["aux_hidden"].shape == (2, 9, (num_layers + 1) * hidden)
    for position, k in enumerate(layer_ids[:-1]):  # HF's hidden_states[k] (k < L) is vLLM's id k
        piece = out["aux_hidden"][..., position * hidden : (position + 1) * hidden]
        torch.testing.assert_close(piece[real], reference.hidden_states[k][real], rtol=1e-5, atol=1e-5)
    last = out["aux_hidden"][..., num_layers * hidden :]
    torch.testing.assert_close(last, out["last_hidden"])
    # id L is BEFORE the final norm: HF's last hidden state is after it, and norm + lm_head gives the logits
    assert not torch.allclose(last[real], reference.hidden_states[num_layers][real], atol=1e-3)
    with torch.no_grad():
        logits = tiny_llama.lm_head(tiny_llama.model.norm(out["last_hidden"]))
    torch.testing.assert_close(logits[real], reference.logits[real], rtol=1e-4, atol=1e-4)


def test_default_ids_padding_side_and_dtype(tiny_llama):
    capture = FeatureCapture(tiny_llama)
    assert capture.aux_layer_ids == default_aux_layer_ids(8) == [2, 4, 5]
    ids, mask = batch(1)
    right = capture.capture(ids, mask)
    assert right["aux_hidden"].dtype == torch.float32 and right["last_hidden"].shape == (2, 9, 64)
    left_ids, left_mask = torch.zeros_like(ids), torch.zeros_like(mask)  # row 1 left-padded instead
    left_ids[0], left_mask[0] = ids[0], 1
    left_ids[1, 3:], left_mask[1, 3:] = ids[1, :6], 1
    left = capture.capture(left_ids, left_mask)
    torch.testing.assert_close(left["aux_hidden"][1, 3:], right["aux_hidden"][1, :6], rtol=1e-4, atol=1e-4)
    kept = FeatureCapture(tiny_llama.to(torch.bfloat16), out_dtype=None).capture(ids, mask)
    tiny_llama.to(torch.float32)
    assert kept["aux_hidden"].dtype == torch.bfloat16


@pytest.mark.parametrize("bad", [[-1, 2], [2, 9]])
def test_aux_ids_outside_zero_to_L_are_refused(tiny_llama, bad):
    with pytest.raises(ValueError, match=r"outside \[0, 8\].*fix the recipe"):
        FeatureCapture(tiny_llama, bad)


@pytest.mark.parametrize("bad", [[2, 4, 4], [5, 2, 4]])
def test_repeated_or_unsorted_aux_ids_are_refused(tiny_llama, bad):
    with pytest.raises(ValueError, match="distinct and ascending"):
        FeatureCapture(tiny_llama, bad)


def test_fingerprint_ignores_load_dtype_but_not_weights(tiny_llama_dir, tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM

    fp32 = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    bf16 = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    assert verifier_fingerprint(fp32) == verifier_fingerprint(bf16)
    with torch.no_grad():
        fp32.model.layers[3].input_layernorm.weight.mul_(1.5)  # a fine-tune that touches one layer
    assert verifier_fingerprint(fp32) != verifier_fingerprint(bf16)
    other = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    assert verifier_fingerprint(other) != verifier_fingerprint(bf16)
