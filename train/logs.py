"""Where progress goes: ``metrics.jsonl`` in the run dir, a readable console line, a tqdm bar (tokens/s, ETA) and
Weights & Biases (``logging.wandb.mode``: online, offline — written under the run dir, no network — or disabled).

Only the main process writes; on other ranks every method is a no-op. wandb is imported only when enabled, and a
resumed run continues the same wandb run (its id is kept in ``<run_dir>/wandb_id``).
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

from speculators.export.model_card import format_duration
from train.settings import TrainSettings


def console_line(record: dict[str, Any], total_steps: int) -> str:
    """``step 120/1000 ep 1 | loss 2.3100 | acc 0.55/0.41/0.30 | lr 1.00e-04 | 1234 tok/s | eta 10.0 min``."""
    accs = [record[k] for k in sorted(record) if k.startswith("train/acc_")]
    parts = [
        f"step {record['step']}/{total_steps} ep {record.get('epoch', 0)}",
        f"loss {record.get('train/loss', float('nan')):.4f}",
    ]
    if accs:
        parts.append("acc " + "/".join(f"{a:.2f}" for a in accs))
    parts += [f"lr {record.get('lr', 0.0):.2e}", f"{record.get('tokens_per_s', 0.0):.0f} tok/s"]
    if "eta_s" in record:
        parts.append(f"eta {format_duration(record['eta_s'])}")
    return " | ".join(parts)


def eval_line(record: dict[str, Any]) -> str:
    accs = [record[k] for k in sorted(record) if k.startswith("eval/acc_")]
    return (
        f"eval @ step {record['step']} | loss {record['eval/loss']:.4f} | acc "
        + "/".join(f"{a:.2f}" for a in accs)
        + f" | acceptance length {record['eval/acceptance_length']:.3f} "
        f"(max {record['eval/acceptance_length_max']:.2f})"
    )


class RunLogger:
    def __init__(
        self, settings: TrainSettings, run_dir: Path, is_main: bool, total_steps: int, start_step: int
    ) -> None:
        self.is_main = is_main
        self.run_dir = run_dir
        self.total_steps = total_steps
        self.metrics_path = run_dir / "metrics.jsonl"
        self.bar = None
        self.wandb_run = None
        if not is_main:
            return
        self._truncate_after(start_step)
        if settings.logging.progress_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, desc="train"
            )
        if settings.logging.wandb.mode != "disabled":
            self.wandb_run = self._start_wandb(settings)

    def _truncate_after(self, step: int) -> None:
        """A resumed run redoes the steps after its checkpoint: drop their records from the killed attempt."""
        if not self.metrics_path.is_file():
            return
        kept = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except json.JSONDecodeError:
                continue
        self.metrics_path.write_text("".join(f"{line}\n" for line in kept))

    def _start_wandb(self, settings: TrainSettings):
        import wandb

        id_file = self.run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id)
        run = settings.logging.wandb
        return wandb.init(
            project=run.project,
            entity=run.entity,
            name=run.name,
            tags=list(run.tags),
            mode=run.mode,
            dir=str(self.run_dir),
            id=run_id,
            resume="allow",
            config=settings.resolved,
        )

    def log(self, record: dict[str, Any], console: str | None = None) -> None:
        if not self.is_main:
            return
        record = {"timestamp": time.time(), **record}
        with open(self.metrics_path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
            self.wandb_run.log(numbers, step=int(record["step"]))
        if console:
            self.write(console)

    def write(self, text: str) -> None:
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def advance(self, steps: int, postfix: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.update(steps)
            self.bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


__all__ = ["RunLogger", "console_line", "eval_line"]
