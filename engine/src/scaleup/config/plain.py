"""Turning the Hydra config into plain objects the jobs and checkpoints can carry."""

from __future__ import annotations

import logging
import pkgutil
from pathlib import Path
from typing import Any

import lightning as L
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("scaleup")


def to_plain(cfg: DictConfig) -> dict[str, Any]:
    """Resolved config as plain dicts and lists: safe to pickle into checkpoints and load with weights_only."""
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


def is_float64(precision: Any) -> bool:
    """Whether a `trainer.precision` value means float64 weights (Lightning accepts these spellings)."""
    return str(precision) in ("64", "64-true", "double")


def build_model(model_cfg: dict[str, Any], precision: Any = "32-true") -> L.LightningModule:
    """The LightningModule from `model` config; nested `net`/`optimizer` stay dicts (it builds them itself).

    Built in float64 for `64-true`: Lightning loads a checkpoint's weights into the module before its precision
    plugin casts the module to float64, so a float32 module would round every resumed or evaluated weight.
    """
    kwargs = dict(model_cfg)
    model = get_class(kwargs.pop("_target_"))(**kwargs)
    return model.double() if is_float64(precision) else model


def retarget(tree: Any, package: str) -> Any:
    """`tree` with every `_target_` that no longer imports moved to your package `package`, where it exists there.

    A checkpoint's stored config names your package as it was called when it trained: before a rename, or the
    template's own `myproject` in a project made with copier. `myproject.models.nets.DigitsCNN` becomes
    `<package>.models.nets.DigitsCNN`. A target that still imports, or that is nowhere in `package`, stays as it is
    (building it then fails with its own name in the message).
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
    """Whether the dotted path `target` names something importable. Quietly: hydra's `get_object` logs an ERROR for
    each target that does not import, which a checkpoint's stored targets after a rename are, as expected."""
    try:
        pkgutil.resolve_name(target)
    except Exception:  # ImportError, AttributeError, or the module's own error on import
        return False
    return True


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


def log_rows(title: str, rows: list[tuple[str, str]]) -> None:
    """Log a title and aligned `name  value` rows under it (`(none)` for no rows)."""
    width = max((len(name) for name, _ in rows), default=0)
    lines = [f"  {name:<{width}}  {value}" for name, value in rows] or ["  (none)"]
    log.info("\n".join([title, *lines]))


def write_yaml(data: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(data)))
