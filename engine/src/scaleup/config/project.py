"""Where a project's configs are: `configs/` in the folder its commands run from (where train.py is); and a config
composed from them set up as the run `@hydra.main` would start."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, open_dict, read_write

from scaleup.errors import UserError


def project_configs() -> Path:
    """The project's configs/ (its top configs and its own groups; the engine's come from pkg://scaleup.conf)."""
    configs = Path.cwd() / "configs"
    if not (configs / "train.yaml").is_file():
        raise UserError(f"no configs/train.yaml in {Path.cwd()}: run it from your project's folder (train.py's)")
    return configs


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
