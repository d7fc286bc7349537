"""Turning the Hydra config into plain objects the jobs and checkpoints can carry."""

from __future__ import annotations

import pkgutil
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf


def to_plain(cfg: DictConfig) -> dict[str, Any]:
    """Resolved config as plain dicts and lists: safe to pickle into checkpoints and load with weights_only."""
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


def is_plain(value: Any) -> bool:
    """Whether `value` is plain data (what `torch.load(..., weights_only=True)` reads): numbers, strings, None, and
    lists, tuples and dicts of them."""
    if isinstance(value, dict):
        return all(is_plain(key) and is_plain(item) for key, item in value.items())
    if isinstance(value, list | tuple):
        return all(map(is_plain, value))
    return value is None or isinstance(value, bool | int | float | str)


def is_float64(precision: Any) -> bool:
    """Whether a `trainer.precision` value means float64 weights (Lightning accepts these spellings)."""
    return str(precision) in ("64", "64-true", "double")


def retarget(tree: Any, package: str) -> Any:
    """`tree` with every `_target_` that no longer imports moved to your package `package`, where it exists there.

    A checkpoint's stored config names your package as it was called when it trained: before a rename, or the
    template's own `myproject` in a project made with copier. `myproject.models.nets.DigitsCNN` becomes
    `<package>.models.nets.DigitsCNN`. A target that still imports, or that is nowhere in `package`, stays as it is
    (config/stored.py names it).
    """
    if isinstance(tree, list):
        return [retarget(item, package) for item in tree]
    if not isinstance(tree, dict):
        return tree
    moved = {key: retarget(value, package) for key, value in tree.items()}
    target = moved.get("_target_")
    if isinstance(target, str) and not imports(target):
        candidate = f"{package}.{target.partition('.')[2]}"
        if imports(candidate):
            moved["_target_"] = candidate
    return moved


def imports(target: str) -> bool:
    """Whether the dotted path `target` names something importable."""
    return import_problem(target) is None


def import_problem(target: str) -> str | None:
    """Why the dotted path `target` does not import (the error's message), or None where it does. Quietly: hydra's
    `get_object` logs an ERROR for each target that does not import, which a checkpoint's stored targets after a
    rename are, as expected."""
    try:
        pkgutil.resolve_name(target)
    except Exception as err:  # ImportError, AttributeError, or the module's own error on import
        return str(err) or type(err).__name__
    return None


def instantiate_each(group: dict[str, Any] | None) -> list[Any]:
    """Instantiate every entry of a config group that has a `_target_` (callbacks, loggers)."""
    return [instantiate(entry) for entry in (group or {}).values() if isinstance(entry, dict) and "_target_" in entry]


def flatten(tree: dict[str, Any], sep: str = ".") -> dict[str, Any]:
    """Nested dicts as one level: {"net": {"width": 32}} -> {"net.width": 32} (or "net/width" with sep="/")."""
    items: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            items.update({f"{key}{sep}{inner}": v for inner, v in flatten(value, sep).items()})
        else:
            items[str(key)] = value
    return items


def lookup(tree: Any, path: str) -> Any:
    """The entry of nested dicts at a dotted path ("net.num_classes"; "" is the tree itself), or None."""
    for part in path.split(".") if path else ():
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def write_yaml(data: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(data)))
