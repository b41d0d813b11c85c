"""Speculative-decoding drafts (EAGLE-3, HASS, EAGLE-3.1, P-EAGLE, DFlash, DSpark, DFlash2, MTP) and the speculators
checkpoint format vLLM serves: the draft models, one unit per algorithm (``algorithms``) and per verifier family
(``families``), export, conversion and validation of checkpoints, our decoding engine, evaluation and the vLLM
bridge.

The library imports torch, transformers and safetensors only; DeepSpeed, Hydra and wandb belong to ``train/``.
"""

__version__ = "0.1.0"
