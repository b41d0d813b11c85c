"""A Hydra launcher that runs every multirun job in its own ``accelerate launch``.

``--multirun`` inside ``accelerate launch`` breaks on job 2 (every rank runs the whole sweep, and accelerate's
process state survives the first job). This launcher inverts it: the sweep runs in one plain Python process and
each job is a fresh ``accelerate launch [--multi_gpu] --num_processes N train/run.py <job overrides>``, with
``run_dir`` set to the job's sweep directory and the data directory pinned to the recipe's (jobs share features).

It lives in the ``hydra_plugins`` namespace because Hydra only instantiates launchers from there; ``train/`` is on
``sys.path`` whenever ``train/run.py`` runs, which makes it importable. Select it with
``hydra/launcher=accelerate`` (``recipes/hydra/launcher/accelerate.yaml``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

from train.assemble import free_port


def accelerate_command() -> list[str]:
    """The ``accelerate`` console script of this interpreter's environment."""
    script = Path(sys.executable).with_name("accelerate")
    return [str(script)] if script.exists() else [shutil.which("accelerate") or "accelerate"]


class AccelerateLauncher(Launcher):
    def __init__(
        self, num_processes: int = 1, extra_args: Sequence[str] = (), script: str = "train/run.py"
    ) -> None:
        super().__init__()
        self.num_processes = int(num_processes)
        self.extra_args = [str(a) for a in extra_args]
        self.script = script
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context

    def job_command(self, overrides: Sequence[str], job_dir: Path, data_dir: str) -> list[str]:
        launch = [
            *accelerate_command(),
            "launch",
            "--num_machines",
            "1",
            "--num_processes",
            str(self.num_processes),
        ]
        launch += ["--dynamo_backend", "no", "--mixed_precision", "no"]
        if self.num_processes > 1:
            launch.append("--multi_gpu")  # required on CPU hosts too: without it accelerate runs ONE process
            if "--main_process_port" not in self.extra_args:  # a fixed default port collides with other runs
                launch += ["--main_process_port", str(free_port())]
        script = Path(self.script)
        if not script.is_absolute():
            script = Path(__file__).resolve().parents[2] / script
        job = [f"run_dir={job_dir}", f"train.data_dir={data_dir}", f"hydra.run.dir={job_dir}/hydra"]
        return [*launch, *self.extra_args, str(script), *filter_overrides(overrides), *job]

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        runs = []
        for offset, overrides in enumerate(job_overrides):
            num = initial_job_idx + offset
            job_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(job_cfg):
                job_cfg.hydra.job.id = num
                job_cfg.hydra.job.num = num
            job_dir = Path(str(job_cfg.hydra.sweep.dir)) / str(job_cfg.hydra.sweep.subdir)
            command = self.job_command(overrides, job_dir, str(job_cfg.train.data_dir))
            print(f"[sweep] job #{num}: {' '.join(filter_overrides(overrides))} -> {job_dir}", flush=True)
            code = subprocess.run(command, check=False).returncode
            result = JobReturn(
                overrides=list(overrides),
                cfg=job_cfg,
                hydra_cfg=job_cfg,
                working_dir=str(job_dir),
                task_name=str(job_cfg.hydra.job.name),
                status=JobStatus.COMPLETED if code == 0 else JobStatus.FAILED,
            )
            result.return_value = code if code == 0 else RuntimeError(f"job #{num} exited with {code}")
            runs.append(result)
        return runs
