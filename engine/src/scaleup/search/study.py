"""The study's database, opened the same way by the search and by its trials (in other processes, or machines)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import optuna

# The trial's user attributes the search and its trials exchange through the database.
OVERRIDES = "overrides"  # the trial's command line: what the search resumes it with, and prints for the best
RUN_DIR = "run_dir"
PRUNED_AT_STEP = "pruned_at_step"


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
