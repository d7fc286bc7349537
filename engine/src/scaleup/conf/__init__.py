"""The engine's Hydra config groups: on Hydra's search path of every app in the environment, after the project's own
configs/, through the engine's SearchPathPlugin (hydra_plugins/scaleup_searchpath)."""

from importlib.resources import files
from typing import Any

SEARCHPATH = "pkg://scaleup.conf"  # what the plugin appends to Hydra's search path


def engine_groups() -> list[str]:
    """The engine's top-level config groups: trainer, strategy, callbacks, logger, ..."""
    return sorted(entry.name for entry in files(__name__).iterdir() if entry.is_dir() and entry.name != "__pycache__")


def group_values(option: str) -> dict[str, Any]:
    """The keys and values of the engine's group option `option` (`loader/default`, `strategy/_base`) as its YAML file
    states them: for code that runs where no config composes the group (eval.py has no `strategy`; a data module built
    in a notebook has no `loader`) and takes the same defaults, stated once, there."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(files(__name__).joinpath(f"{option}.yaml")))
