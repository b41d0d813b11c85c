"""What every draft model shares: the decoder layers (``layers``) and the checkpoint load/save base (``draft``).
Each algorithm's own model is ``speculators/algorithms/<name>/model.py``."""
