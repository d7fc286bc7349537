"""What `train.py` stores in a checkpoint beside the weights, read back: the config it ran and its plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scaleup.config.plain import retarget
from scaleup.errors import UserError
from scaleup.plan.resolve import Plan


@dataclass(frozen=True)
class StoredRun:
    """The sections of the stored config that a checkpoint's evaluation, export and resume rebuild from (its
    targets found in your package: `retarget`), and the stored plan."""

    data: dict[str, Any]
    model: dict[str, Any]
    loader: dict[str, Any]
    seed: int
    plan: Plan


def stored_run(checkpoint: dict[str, Any], path: str, package: str) -> StoredRun:
    """The config and plan `train.py` stored in the checkpoint, its targets found in your package `package` (also
    when it was trained under another name)."""
    if "scaleup" not in checkpoint or "state_dict" not in checkpoint:
        raise UserError(
            f"{path} was not written by this template's train.py (no stored config); load its state_dict "
            "with scaleup.checkpoints.io.load_weights instead"
        )
    stored = checkpoint["scaleup"]
    config = retarget(stored["config"], package)
    return StoredRun(config["data"], config["model"], config["loader"], config["seed"], Plan.from_dict(stored["plan"]))


def stored_plan(checkpoint: dict[str, Any]) -> Plan | None:
    """The plan stored in a checkpoint; None in one that scaleup's train.py did not write."""
    stored = checkpoint.get("scaleup", {}).get("plan")
    return Plan.from_dict(stored) if stored else None


def stored_model(checkpoint: dict[str, Any], package: str) -> dict[str, Any]:
    """The `model` config stored in a checkpoint, its targets found in `package`; empty where none is stored."""
    return retarget(checkpoint.get("scaleup", {}).get("config", {}).get("model", {}), package)
