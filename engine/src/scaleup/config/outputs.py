"""Where a training run will write, checked when it starts: its checkpoints, and the data it downloads into
`paths.data_dir`. A directory that cannot be written would otherwise be found after an epoch of training (the first
save), or reported as a failed download."""

from __future__ import annotations

import os
from pathlib import Path

from scaleup.config.plain import flatten
from scaleup.config.typed import TrainConfig
from scaleup.errors import UserError, why_unwritable


def check_outputs(config: TrainConfig) -> None:
    """Refuse a run that could not write its checkpoints (`checkpoint.dirpath`), or create a path of its `data` section
    under `paths.data_dir` that is not there yet (where the data module downloads to). Data already in place may be
    read-only; a URL (s3://...) is checked by its file system when written; a dry run writes neither."""
    if config.dry_run:
        return
    dirpath = config.checkpoint.dirpath
    if "://" not in dirpath and (err := why_unwritable(dirpath)) is not None:
        raise UserError(
            f"cannot write checkpoints into {dirpath}: {err.strerror or err}; "
            "pass checkpoint.dirpath=<a directory you can write>"
        )
    data_dir = config.plain.get("paths", {}).get("data_dir")
    for key, value in flatten(config.data).items():
        if not (isinstance(value, str) and data_dir and inside(value, data_dir)) or Path(value).exists():
            continue
        if (err := why_unwritable(value)) is not None:
            raise UserError(
                f"cannot create data.{key}={value} in paths.data_dir={data_dir}: {err.strerror or err}; pass "
                f"paths.data_dir=<a directory you can write> (or data.{key}=<where the data is>)"
            )


def inside(path: str, directory: str) -> bool:
    """Whether `path` is `directory` or lies in it."""
    return Path(os.path.abspath(path)).is_relative_to(os.path.abspath(directory))
