"""Evaluation of a draft with the decoding engine: prompts, acceptance, speedup, plots (``speculators eval``)."""
