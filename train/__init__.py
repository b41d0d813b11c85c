"""The training stage: EAGLE-3 / HASS / EAGLE-3.1 (training-time test), P-EAGLE, DFlash, DSpark, DFlash2 and MTP
drafts trained under accelerate (+ DeepSpeed ZeRO); each algorithm's objective is one module of ``objectives/``
named after it (``eagle3`` also trains HASS and EAGLE-3.1, ``dflash`` also DSpark; ``peagle``, ``dflash2``, ``mtp``).

Entry point: ``accelerate launch train/run.py recipe=<name>``. Modules, one concept each: ``ttt_attention`` (linear
memory TTT attention), ``targets`` (verifier distributions from stored pre-norm states), ``losses`` (soft CE / KL,
HASS top-K, accuracy and simulated acceptance), ``data`` (global-batch plan, packing with document ids),
``features`` (offline shards or the verifier online, one source each), ``settings`` (the recipe's train-side
groups, typed and validated before anything starts), ``unroll`` (the k-step TTT forward), ``assemble`` (draft,
optimizer, schedule, accelerator and DeepSpeed), ``checkpointing`` (writing step checkpoints and exact resume; the run-dir layout is
:mod:`speculators.runs`), ``step_stats`` (the sums the loops all-reduce), ``evaluation``, ``trainer`` (the loop)
and ``run``; ``hydra_plugins/`` holds the Hydra launcher that runs each sweep job under its own ``accelerate launch``.
"""
