"""The engine's Hydra config groups; a project's top configs find them with `hydra.searchpath: [pkg://scaleup.conf]`."""

from importlib.resources import files

SEARCHPATH = "pkg://scaleup.conf"  # what a project's top configs put in hydra.searchpath


def engine_groups() -> list[str]:
    """The engine's top-level config groups: trainer, strategy, callbacks, logger, ..."""
    return sorted(entry.name for entry in files(__name__).iterdir() if entry.is_dir() and entry.name != "__pycache__")
