"""The ``vllm`` capture back end: features from vLLM's own ``extract_hidden_states`` speculative method.

vLLM (its own virtualenv, one :class:`~speculators.serving.VllmSession` worker for the whole run) prefills every
sequence of a shard, as the token ids our pipeline made (no template, no BOS added: ``max_tokens=1``, the one
sampled token is thrown away), while vLLM's ``ExampleHiddenStatesConnector`` writes each request's
``hidden_states`` [T, k, H] and ``token_ids`` [T] to a safetensors file in a private spool directory. This module
reads each file, checks its token ids are the ones sent, splits it into our ``aux_hidden`` / ``last_hidden`` and
deletes it. On CPU the worker runs a CPU-safe subclass of that connector
(``speculators/serving/vllm_hidden_states.py`` says why).

Layer ids: vLLM's id k is the residual stream ENTERING decoder layer k (``hidden + residual`` after layer k-1; id 0
the embeddings) and id L the last layer's output before the final norm: our convention, so the recipe's aux ids
are passed as they are, with L added for ``last_hidden``. vLLM returns the captured layers in increasing id order
(each id once), whatever order it was given, so the split goes by position in the sorted list.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file

from data_gen.capture_backends import CaptureSettings, Features, VerifierHandle


class VllmCapture:
    """Captures through a vLLM worker; :meth:`close` ends it and removes the spool."""

    name = "vllm"
    needs_verifier_on_device = False

    def __init__(
        self,
        verifier_path: str,
        aux_layer_ids: Sequence[int],
        num_layers: int,
        dtype: str,
        max_length: int,
        settings: CaptureSettings,
    ) -> None:
        from speculators.serving.vllm_bridge import VllmSession, vllm_available

        if not vllm_available():
            raise RuntimeError(
                "data_gen.capture.backend=vllm is not available: the vLLM virtualenv is missing or has no vLLM "
                "(run `make vllm-env`, or set SPECULATORS_VLLM_PYTHON); or use backend=transformers"
            )
        self.verifier_path = verifier_path
        self.aux_layer_ids = [int(i) for i in aux_layer_ids]
        self.num_layers = int(num_layers)
        self.captured_ids = sorted({*self.aux_layer_ids, self.num_layers})  # vLLM's output order
        self.dtype = dtype
        self.max_model_len = int(max_length) + 1  # the prompt and the one token vLLM must sample
        self.settings = settings
        self.spool: Path | None = None  # made on first use: a refused run leaves nothing behind
        self.session = VllmSession(threads=settings.threads or os.cpu_count())

    @classmethod
    def build(cls, settings: CaptureSettings, verifier: VerifierHandle) -> VllmCapture:
        return cls(
            verifier.path,
            verifier.aux_layer_ids,
            verifier.num_layers,
            verifier.dtype,
            verifier.max_length,
            settings,
        )

    def move_to(self, device: str | torch.device) -> None:
        return None  # the worker takes its own GPUs (vllm_bridge.vllm_placement) when it starts

    def capture(self, sequences: Sequence[Sequence[int]]) -> list[Features]:
        if not sequences:
            return []
        from speculators.serving.vllm_bridge import VllmRequest

        if self.spool is None:
            self.spool = Path(tempfile.mkdtemp(prefix="vllm-hidden-states-"))
        request = VllmRequest(
            model=self.verifier_path,
            prompts=[[int(t) for t in sequence] for sequence in sequences],
            max_tokens=1,
            temperature=0.0,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            kv_cache_gib=self.settings.kv_cache_gib,
            gpu_memory_utilization=self.settings.gpu_memory_utilization,
            tensor_parallel_size=self.settings.tensor_parallel_size,
            hidden_states_layer_ids=self.captured_ids,
            hidden_states_dir=str(self.spool),
            name="capture",
        )
        result = self.session.run(request)
        paths = result.hidden_states_paths or []
        if len(paths) != len(sequences):
            raise RuntimeError(
                f"vLLM returned {len(paths)} hidden-state files for {len(sequences)} sequences"
            )
        return [self._read(Path(path), sequence) for path, sequence in zip(paths, sequences, strict=True)]

    def _read(self, path: Path, sequence: Sequence[int]) -> Features:
        """One request's file, checked against what was sent, split into (aux, last), then deleted."""
        tensors = load_file(str(path))
        path.unlink()
        sent = torch.tensor([int(t) for t in sequence], dtype=torch.long)
        if not torch.equal(tensors["token_ids"].long(), sent):
            raise RuntimeError(
                f"{path.name}: vLLM captured {tensors['token_ids'].numel()} tokens that differ from the "
                f"{sent.numel()} sent; features would not belong to the sample"
            )
        states = tensors["hidden_states"]  # [T, len(captured_ids), H]
        if tuple(states.shape[:2]) != (sent.numel(), len(self.captured_ids)):
            raise RuntimeError(
                f"{path.name}: hidden_states {tuple(states.shape)}, expected [{sent.numel()}, "
                f"{len(self.captured_ids)}, H] for layers {self.captured_ids}"
            )
        column = {layer: i for i, layer in enumerate(self.captured_ids)}
        aux = torch.cat([states[:, column[layer]] for layer in self.aux_layer_ids], dim=-1)
        return aux, states[:, column[self.num_layers]].clone()

    def close(self) -> None:
        self.session.close()
        if self.spool is not None:
            shutil.rmtree(self.spool, ignore_errors=True)
            self.spool = None


__all__ = ["VllmCapture"]
