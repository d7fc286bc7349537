"""The engine's registry: extras that a setting switches on rather than a part the config names, found by name through
the entry points the engine's package declares (engine/pyproject.toml), so that the core imports none of them and
runs without them: the auto batch size (`scaleup.per_device_caps`), the failure watch (`scaleup.job_watch`).
"""

from __future__ import annotations

import importlib.metadata
from typing import Any


def registered(group: str, name: str) -> Any | None:
    """What the entry point `name` of the group `scaleup.<group>` names, or None where none loads: not registered, or
    its extra's files are gone."""
    for entry in importlib.metadata.entry_points(group=f"scaleup.{group}", name=name):
        try:
            return entry.load()
        except ImportError:
            return None
    return None
