"""Where a project's configs are: `configs/` in the folder its commands run from (where train.py is)."""

from __future__ import annotations

from pathlib import Path

from scaleup.errors import UserError


def project_configs() -> Path:
    """The project's configs/ (its top configs and its own groups; the engine's come from pkg://scaleup.conf)."""
    configs = Path.cwd() / "configs"
    if not (configs / "train.yaml").is_file():
        raise UserError(f"no configs/train.yaml in {Path.cwd()}: run it from your project's folder (train.py's)")
    return configs
