"""Train EAGLE-3 / HASS speculative-decoding drafts and read/write the standard speculators checkpoint format.

The library imports torch, transformers and safetensors only; DeepSpeed, Hydra and wandb belong to ``train/``.
"""

__version__ = "0.1.0"
