"""The engine's Hydra config groups: on Hydra's search path of every app in the environment, after the project's own
configs/, through the engine's SearchPathPlugin (hydra_plugins/scaleup_searchpath)."""

from importlib.resources import files
from typing import Any

SEARCHPATH = "pkg://scaleup.conf"  # what the plugin appends to Hydra's search path


def engine_groups() -> list[str]:
    """The engine's top-level config groups: trainer, strategy, callbacks, logger, ..."""
    return sorted(entry.name for entry in files(__name__).iterdir() if entry.is_dir() and entry.name != "__pycache__")


def group_value(option: str, key: str) -> Any:
    """The value `key` holds in the engine's group option `option` (`strategy/_base`), as its YAML file states it:
    for a job that composes no such group (eval.py has no `strategy`) and reads the same default."""
    from omegaconf import OmegaConf

    return OmegaConf.load(files(__name__).joinpath(f"{option}.yaml"))[key]
