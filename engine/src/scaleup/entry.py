"""What a project's entry points call: `python train.py [key=value ...]` is `main("train", <project>/configs)`.

Hydra composes `configs/<job>.yaml` (the project's top config; the engine's groups are on Hydra's search path
through the engine's plugin, hydra_plugins/scaleup_searchpath) with the command line, and the engine's job runs it.
A misspelled key or group option, or a value the schema refuses, is one `error:` line and exit code 2.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from scaleup.config.composition import run_app
from scaleup.distributed.run_dir import register_resolvers
from scaleup.engine_pin import warn_if_another_engine
from scaleup.errors import exit_on_user_error

# Each job's function, imported when it runs (eval.py need not import the training code).
JOBS = {"train": "scaleup.train:train", "eval": "scaleup.evaluate:evaluate", "export": "scaleup.export:export"}


def job_function(job: str) -> Callable[[DictConfig], Any]:
    """The engine's function that runs `job`."""
    module, name = JOBS[job].split(":")
    return getattr(importlib.import_module(module), name)


def main(job: str, configs: str | Path) -> None:
    """Run `job` (train, eval or export) on `configs/<job>.yaml` and the command line's overrides."""
    if job not in JOBS:
        raise ValueError(f"job={job}: one of {', '.join(JOBS)}")
    configs = Path(configs).resolve()
    register_resolvers()
    run = exit_on_user_error(job_function(job))

    def start(cfg: DictConfig) -> Any:
        warn_if_another_engine(configs.parent)  # the project's pyproject.toml, beside its configs/
        return run(cfg)

    run_app(start, configs, job)
