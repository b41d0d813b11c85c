"""The data-generation stage: chat data → loss masks → (regenerated responses) → verifier hidden states on disk
(one layout for every algorithm: every registered drafter trains on it, offline or streamed; MTP reads the last
layer's state among them).

Modules (one concept each): ``sources`` (load + normalise + split conversations), ``masks`` (assistant-only loss
masks from the verifier's chat template), ``regenerate`` (optional on-policy responses), ``capture`` (the batched
verifier forward, also used online by the trainer), ``store`` (sharded safetensors + manifest: THE contract with
the trainer), ``stats`` (assistant-token counts for the draft vocabulary), ``pipeline`` (the resumable per-shard
loop) and ``run`` (the Hydra entry point).
"""
