"""Compiled flex attention sees a small fixed set of shapes over a whole epoch, and one shape more is an error.

On GPUs the trainer compiles ``flex_attention`` (and ``create_block_mask``) with ``dynamic=False``. Past torch's
recompile limit dynamo used to fall back silently to the uncompiled kernel, which materialises the full score
matrix and runs out of memory at the 8B recipe. Here a Trainer configured for flex (built with grad disabled: flex
cannot train on CPU) sets the recompile limit and makes it fatal; then every micro batch of an epoch (packing on,
2 or 3 rows, 3 padded to 4) and every evaluation batch is replayed through the same compile path (TTTAttention ->
flex_block_mask -> compiled create_block_mask -> compiled flex_attention) with the draft's q/k/v shapes.

Two CPU stand-ins, both outside the shape/guard logic under test: the compiler backend is ``aot_eager`` (dynamo
traces and guards exactly as with inductor; inductor's CPU codegen would add ~20 s per shape), and the training
unroll's q/k/v do not require grad (flex has no CPU backward) but run with grad mode on, which is the guard that
tells a training call from an evaluation call.
"""

from __future__ import annotations

import pytest
import torch

from tests.train.conftest import compose, tiny_overrides
from train.data import row_buckets, run_loader
from train.trainer import Trainer, reset_distributed
from train.ttt_attention import TTTAttention, dense_ttt_attention, flex_shape_variants

BACKEND = "aot_eager"


def cache_entries(fn) -> int:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(fn.__code__))


def unroll_attention(
    trainer: Trainer, document_ids: torch.Tensor, steps: int, check_values: bool = True
) -> None:
    """One TTT unroll's attention calls with the draft's q/k/v shapes and dtype (every layer, every step)."""
    layers = trainer.accelerator.unwrap_model(trainer.model).draft.layers
    attn = layers[0].self_attn
    dtype = attn.q_proj.weight.dtype
    rows, length = document_ids.shape
    with torch.no_grad():  # (flex refuses to be set up for training on CPU)
        attend = TTTAttention(document_ids, "flex", total_steps=steps, compile_backend=BACKEND)
    keys = {layer: [] for layer in range(len(layers))}
    values = {layer: [] for layer in range(len(layers))}
    for _ in range(steps):
        for layer in range(len(layers)):
            q = torch.randn(rows, attn.num_heads, length, attn.head_dim, dtype=dtype)
            k, v = torch.randn(2, rows, attn.num_kv_heads, length, attn.head_dim, dtype=dtype)
            keys[layer].append(k)
            values[layer].append(v)
            out = attend(layer, q, k, v)
            if check_values:  # the compiled path (padded keys, tensor step index) against the dense reference
                reference = dense_ttt_attention(q, keys[layer], values[layer], document_ids)
                torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


@pytest.fixture
def flex_trainer(sharp_verifier, tiny_data, tmp_path):
    import torch._dynamo.config as dynamo_config

    saved = (dynamo_config.recompile_limit, dynamo_config.fail_on_recompile_limit_hit)
    overrides = tiny_overrides(
        sharp_verifier,
        tiny_data,
        tmp_path / "run",
        "train.attention_backend=flex",
        "train.micro_batch_size=4",
        "train.max_length=72",  # documents of 29-46 tokens: 2 or 3 packed rows per micro batch of 4
        "train.packing=true",
        "train.epochs=1",
        "eval.k=4",  # evaluation unrolls further than training (3): another key length
    )
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            trainer = Trainer(compose(overrides), tmp_path / "run")
    except BaseException:
        reset_distributed()
        raise
    try:
        yield trainer
    finally:
        trainer.close()
        torch._dynamo.reset()
        dynamo_config.recompile_limit, dynamo_config.fail_on_recompile_limit_hit = saved


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
def test_an_epoch_compiles_a_fixed_set_of_flex_shapes(flex_trainer):
    import torch._dynamo.config as dynamo_config
    from torch._dynamo.exc import FailOnRecompileLimitHit, Unsupported
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    trainer, mbs = flex_trainer, 4
    variants = flex_shape_variants(len(row_buckets(mbs)))
    assert row_buckets(mbs) == [1, 2, 4] and variants == 6
    assert dynamo_config.recompile_limit == variants and dynamo_config.fail_on_recompile_limit_hit

    rows_seen, widths = set(), set()
    steps = trainer.plan.steps_per_epoch
    loader = run_loader(trainer.features.train_set, trainer.plan, 0, 0, steps, trainer.features.collate)
    with torch.enable_grad():
        for item in loader:
            batch = trainer.features.batch(item)
            rows_seen.add(int(batch.document_ids.shape[0]))
            widths.add(int(batch.document_ids.shape[1]))
            unroll_attention(trainer, batch.document_ids, trainer.steps)
    with torch.no_grad():
        for batch in trainer.features.eval_batches():
            rows_seen.add(int(batch.document_ids.shape[0]))
            unroll_attention(trainer, batch.document_ids, trainer.settings.eval.k)
    # an epoch of packed micro batches of 4 hit 2 AND 4 rows (3 are padded to 4), all max_length wide
    assert rows_seen == {2, 4} and widths == {72}
    assert cache_entries(flex_attention) == cache_entries(create_block_mask) == 2 * len(rows_seen)

    # another epoch and evaluation compile nothing new
    with torch.no_grad():
        for batch in trainer.features.eval_batches():
            unroll_attention(trainer, batch.document_ids, trainer.settings.eval.k)
    assert cache_entries(flex_attention) == 2 * len(rows_seen)

    # a shape outside the set (3 rows, as unpadded packing gives) past the limit is an error, never a fallback
    one_row = torch.zeros(1, 72, dtype=torch.long)
    with torch.no_grad():
        unroll_attention(trainer, one_row, trainer.settings.eval.k)  # the 1-row bucket: within the limit
    with torch.enable_grad():
        unroll_attention(trainer, one_row, trainer.steps)
    assert cache_entries(flex_attention) == variants
    with pytest.raises((FailOnRecompileLimitHit, Unsupported)), torch.no_grad():
        unroll_attention(trainer, torch.zeros(3, 72, dtype=torch.long), trainer.settings.eval.k)
