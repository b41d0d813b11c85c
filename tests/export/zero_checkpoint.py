"""Write a REAL DeepSpeed ZeRO-3 checkpoint of an EAGLE-3 draft, as a trainer's ``state/`` directory holds it.

Usage: ``python zero_checkpoint.py DRAFT_DIR STATE_DIR REFERENCE.safetensors``. One process, CPU, gloo, fp32,
a torch AdamW client optimizer (no op compiles), one optimizer step so the weights differ from the draft's, then
``engine.save_checkpoint(STATE_DIR, tag="pytorch_model")`` as accelerate's ``save_state`` does. The gathered full
parameters are written to REFERENCE so the test can compare the exporter's output with them exactly. The draft
sits inside a wrapper module (``draft.``-prefixed names), as a trainer's container module would hold it.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch
from safetensors.torch import save_file
from torch import nn

from train.assemble import free_port


class Wrapper(nn.Module):
    def __init__(self, draft: nn.Module) -> None:
        super().__init__()
        self.draft = draft

    def forward(self, input_ids: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1])[None].expand_as(input_ids)
        logits, _ = self.draft(input_ids, self.draft.project_features(aux), positions)
        return logits.float().logsumexp(-1).mean()


def main(draft_dir: str, state_dir: str, reference: str) -> None:
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # skip the g++ shm build
    import deepspeed

    from speculators.algorithms.eagle3.model import Eagle3DraftModel

    torch.manual_seed(0)
    model = Wrapper(Eagle3DraftModel.from_pretrained(draft_dir, dtype=torch.float32))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "zero_force_ds_cpu_optimizer": False,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    hidden = model.draft.config.hidden_size
    n_aux = len(model.draft.config.eagle_aux_hidden_state_layer_ids)
    ids = torch.randint(0, 500, (1, 8))
    loss = engine(ids, torch.randn(1, 8, n_aux * hidden))
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(state_dir, tag="pytorch_model")
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        full = {name: p.detach().clone().contiguous() for name, p in params.items()}
    full.update(
        {
            name: b.detach().clone()
            for name, b in engine.module.named_buffers()
            if name.endswith(("d2t", "t2d"))
        }
    )
    save_file(full, reference)
    deepspeed.comm.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
