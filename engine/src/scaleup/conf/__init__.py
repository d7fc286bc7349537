"""The engine's Hydra config groups: on Hydra's search path of every app in the environment, after the project's own
configs/, through the engine's SearchPathPlugin (hydra_plugins/scaleup_searchpath)."""

from importlib.resources import files

SEARCHPATH = "pkg://scaleup.conf"  # what the plugin appends to Hydra's search path


def engine_groups() -> list[str]:
    """The engine's top-level config groups: trainer, strategy, callbacks, logger, ..."""
    return sorted(entry.name for entry in files(__name__).iterdir() if entry.is_dir() and entry.name != "__pycache__")
