"""What `train.py` stores in a checkpoint beside the weights, read back: the config it ran and its plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scaleup.config.plain import import_problem, imports, retarget
from scaleup.config.project import project_packages
from scaleup.config.schema import targets
from scaleup.errors import UserError
from scaleup.plan.resolve import Plan


@dataclass(frozen=True)
class StoredRun:
    """The sections of the stored config that a checkpoint's evaluation, export and resume rebuild from (their
    targets found in your package: `found`), and the stored plan."""

    data: dict[str, Any]
    model: dict[str, Any]
    loader: dict[str, Any]
    seed: int
    plan: Plan


def stored_run(checkpoint: dict[str, Any], path: str) -> StoredRun:
    """The config and plan `train.py` stored in the checkpoint, the targets of its data and model found in your
    package (also when it was trained under another name)."""
    if "scaleup" not in checkpoint or "state_dict" not in checkpoint:
        what = "was not written by this template's train.py (a checkpoint of plain Lightning or other code)"
        if "state_dict" not in checkpoint:
            what = "holds weights only (a plain state_dict, e.g. an export)"
        raise UserError(
            f"{path} {what}: it stores no config to rebuild the model and data from. Pass a checkpoint a training "
            f"run wrote (<run dir>/checkpoints/best-*.ckpt or last.ckpt), or start a run from these weights with "
            f"init.weights={path}"
        )
    stored = checkpoint["scaleup"]
    config = stored["config"]
    data, model = (found(config[name], name, path) for name in ("data", "model"))
    return StoredRun(data, model, config["loader"], config["seed"], Plan.from_dict(stored["plan"]))


def found(section: dict[str, Any], name: str, path: str) -> dict[str, Any]:
    """The stored `section` (`data` or `model`), each `_target_` that no longer imports found in your package
    (`project_packages`: the packages of your configs' model and data): a checkpoint names your package as it was
    called when it trained, before a rename (`myproject.models.ImageClassifier` is then
    `<your package>.models.ImageClassifier`). A target found in neither place is one line naming both names."""
    if all(imports(node["_target_"]) for _, node in targets(section, name)):
        return section  # nothing moved: no need to compose the project's config
    packages = project_packages()
    for package in packages:
        section = retarget(section, package)
    for key, node in targets(section, name):
        target = node["_target_"]
        if (problem := import_problem(target)) is None:
            continue
        elsewhere = [f"{package}.{target.partition('.')[2]}" for package in packages if package != target.split(".")[0]]
        raise UserError(
            f"{path} was trained with {key}._target_={target}, which does not import ({problem})"
            + (f", nor does {' or '.join(elsewhere)} in your package" if elsewhere else "")
            + f": make the class importable under {'one of these names' if elsewhere else 'that name'}"
        )
    return section


def stored_plan(checkpoint: dict[str, Any]) -> Plan | None:
    """The plan stored in a checkpoint; None in one that scaleup's train.py did not write."""
    stored = checkpoint.get("scaleup", {}).get("plan")
    return Plan.from_dict(stored) if stored else None


def stored_model(checkpoint: dict[str, Any], packages: list[str]) -> dict[str, Any]:
    """The `model` config stored in a checkpoint, its targets that no longer import found in `packages` (those of
    this run's config, `project_packages`); empty where none is stored."""
    model = checkpoint.get("scaleup", {}).get("config", {}).get("model", {})
    for package in packages:
        model = retarget(model, package)
    return model
