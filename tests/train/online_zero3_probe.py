"""Launched by test_online.py under `accelerate launch` (not a test module): builds the Trainer from Hydra
overrides, records how this rank's frozen online verifier holds its weights, then trains as train/run.py does.

    accelerate launch ... tests/train/online_zero3_probe.py <report.json> <hydra overrides...>
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # for the recipes; train/ is an installed package


def verifier_report(verifier) -> dict:
    params = list(verifier.parameters())
    return {
        "ds_attributes": sorted({a for p in params for a in ("ds_id", "ds_status") if hasattr(p, a)}),
        "numel": sum(p.numel() for p in params),
        "empty": sum(p.numel() == 0 for p in params),
        "dtype": str(params[0].dtype),
    }


def main() -> None:
    from hydra import compose, initialize_config_dir

    from train.trainer import Trainer

    report, overrides = Path(sys.argv[1]), sys.argv[2:]
    with initialize_config_dir(config_dir=str(REPO_ROOT / "recipes"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    trainer = Trainer(cfg, cfg.run_dir)
    facts = verifier_report(trainer.features.verifier)
    facts["distributed_type"] = trainer.accelerator.distributed_type.value
    facts["compute_dtype"] = str(trainer.dtype)
    rank = trainer.rank
    trainer.fit()
    trainer.close()
    report.with_name(f"{report.stem}-rank{rank}.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    main()
