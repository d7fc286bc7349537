"""The engine's Hydra config groups: on Hydra's search path of every app in the environment, after the project's own
configs/, through the engine's SearchPathPlugin (hydra_plugins/scaleup_searchpath)."""

import pkgutil
from importlib.resources import files
from typing import Any

SEARCHPATH = "pkg://scaleup.conf"  # what the plugin appends to Hydra's search path


def engine_groups() -> list[str]:
    """The engine's top-level config groups: trainer, strategy, callbacks, logger, ..."""
    return sorted(entry.name for entry in files(__name__).iterdir() if entry.is_dir() and entry.name != "__pycache__")


# Shared parts of the engine's groups that are made from code, not a YAML file: registered in Hydra's ConfigStore by
# the engine's plugin (hydra_plugins/scaleup_searchpath), named in an option's defaults list like a file.
MADE = {"trainer/_lightning": "scaleup.config.schema:lightning_defaults"}


def group_values(option: str) -> dict[str, Any]:
    """The keys and values of the engine's group option `option` (`loader/default`, `strategy/_base`) as its YAML file
    states them: for code that runs where no config composes the group (eval.py has no `strategy`; a data module built
    in a notebook has no `loader`) and takes the same defaults, stated once, there."""
    from omegaconf import OmegaConf

    if option in MADE:
        return pkgutil.resolve_name(MADE[option])()
    return OmegaConf.to_container(OmegaConf.load(files(__name__).joinpath(f"{option}.yaml")))
