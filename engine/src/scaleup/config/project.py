"""Where a project's configs are: `configs/` in the folder its commands run from (where train.py is); and a config
composed from them set up as the run `@hydra.main` would start."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from omegaconf import DictConfig, open_dict, read_write

from scaleup.errors import UserError


def project_configs() -> Path:
    """The project's configs/ (its top configs and its own groups; the engine's come from pkg://scaleup.conf)."""
    configs = Path.cwd() / "configs"
    if not (configs / "train.yaml").is_file():
        raise UserError(f"no configs/train.yaml in {Path.cwd()}: run it from your project's folder (train.py's)")
    return configs


def compose_project(
    job: str,
    overrides: Iterable[str] = (),
    *,
    configs: Path | None = None,
    job_name: str | None = None,
    hydra: bool = True,
) -> DictConfig:
    """configs/<job>.yaml of the project (`configs`, by default `project_configs()`) with `overrides`, as `python
    <job>.py` composes it: with Hydra's own config under `hydra` (for `hydra.job.name`: `job_name`, by default
    `job`), unless `hydra=False`."""
    from hydra import compose, initialize_config_dir

    where = str((configs or project_configs()).resolve())
    with initialize_config_dir(config_dir=where, version_base="1.3", job_name=job_name or job):
        return compose(job, overrides=list(overrides), return_hydra_config=hydra)


def set_up_run(cfg: DictConfig) -> Path:
    """Hydra's runtime for `cfg` (composed with its `hydra` node) as `@hydra.main` sets it up: the working directory,
    the run mode, `HydraConfig.get()`, and the run directory resolved once (its `${now:...}` stamped) into both
    `hydra.run.dir` and `hydra.runtime.output_dir`. Returns the run directory."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    with open_dict(cfg):
        cfg.hydra.runtime.cwd = os.getcwd()
        cfg.hydra.mode = RunMode.RUN
    HydraConfig.instance().set_config(cfg)  # for the ${hydra:...} interpolations in hydra.run.dir
    run_dir = Path(cfg.hydra.run.dir).resolve()
    with read_write(cfg.hydra):
        cfg.hydra.run.dir = cfg.hydra.runtime.output_dir = str(run_dir)
    HydraConfig.instance().set_config(cfg)
    return run_dir
