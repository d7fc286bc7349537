"""The study's database, opened the same way by the search and by its trials (in other processes, or machines)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import optuna
from hydra.core.override_parser.overrides_parser import OverridesParser

# The trial's user attributes the search and its trials exchange through the database.
OVERRIDES = "overrides"  # the trial's command line: what the search resumes it with, and prints for the best
RUN_DIR = "run_dir"
PRUNED_AT_STEP = "pruned_at_step"
# The study's user attribute: its fixed recipe, the overrides every trial shares, as {key: value}.
RECIPE = "recipe"
# Keys that leave a trial's numbers as they are: the search's own settings, where files go, and the topology (the
# trials give the same numbers on any device count).
NOT_RECIPE = ("hydra.", "paths.")
TOPOLOGY = ("trainer.devices", "trainer.num_nodes", "data.num_workers", "data.max_per_device_batch_size")


def storage_url(storage: str | None, sweep_dir: str | Path) -> str:
    """`storage`, or SQLite in the sweep directory."""
    return storage or f"sqlite:///{Path(sweep_dir).resolve() / 'study.db'}"


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """The database behind `url`. SQLite waits up to a minute for a lock (trials running at once write to it)."""
    engine_kwargs: dict[str, Any] = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)


def best_value(trial: optuna.trial.FrozenTrial, maximize: bool) -> float | None:
    """A trial's result: the best of the finite values it reported (the best checkpoint's `monitor.metric`); None
    where it reported none (a run that diverged at once)."""
    values = [value for value in trial.intermediate_values.values() if math.isfinite(value)]
    return (max if maximize else min)(values) if values else None


def recipe(fixed: list[str]) -> dict[str, str]:
    """The fixed recipe of a search's overrides that every trial shares: {key: value} (a later override of a key
    wins; a deleted key reads `(deleted)`), without the keys that leave the trials' numbers as they are."""
    entries: dict[str, str] = {}
    for override in OverridesParser.create().parse_overrides(fixed):
        key = override.key_or_group + (f"@{override.package}" if override.package else "")
        if not key.startswith(NOT_RECIPE) and key not in TOPOLOGY:
            entries[key] = "(deleted)" if override.is_delete() else override.get_value_element_as_str()
    return entries


def recipe_changes(made_with: dict[str, str], now: dict[str, str]) -> list[str]:
    """`key (then -> now)` for each key whose fixed value differs, in key order; a key set on one side only reads
    `(default)` on the other."""
    return [
        f"{key} ({made_with.get(key, '(default)')} -> {now.get(key, '(default)')})"
        for key in sorted(made_with.keys() | now.keys())
        if made_with.get(key) != now.get(key)
    ]
