"""Is the engine that runs the one this project pins?

A project made with copier pins the engine to a template commit (`"scaleup-engine @ git+<template>@<commit>#...`"
in its pyproject.toml). A venv holds one engine: two projects installed in it share whichever was installed last, so
after `copier update` of one, the other silently runs an engine its pin never named. Said once at start-up.
"""

from __future__ import annotations

import json
import logging
import re
from importlib import metadata
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_only

log = logging.getLogger(__name__)

# The commit a pyproject.toml's engine requirement is pinned to
PINNED_COMMIT = re.compile(r'"scaleup-engine(?:\[[^\]"]*\])?\s*@\s*git\+[^"]*@([0-9a-f]{7,40})#subdirectory=engine"')


def installed_commit() -> str | None:
    """The commit the installed engine was built from (pip's direct_url.json), or None: editable or from an index."""
    try:
        direct_url = metadata.distribution("scaleup-engine").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    return json.loads(direct_url or "{}").get("vcs_info", {}).get("commit_id")


def pin_mismatch(pyproject: str, installed: str | None) -> str | None:
    """What to say when the commit `pyproject` pins the engine to is not the `installed` one; None when they agree,
    or when either is unknown (a clone of the template holds the engine unpinned; an editable engine is yours)."""
    pinned = sorted(set(PINNED_COMMIT.findall(pyproject)))
    if len(pinned) != 1 or installed is None or installed.startswith(pinned[0]):
        return None
    return (
        f"this project pins the engine at commit {pinned[0][:12]}, but the engine installed here was built from "
        f"{installed[:12]} (another project in this venv installed it?): results may differ from the pinned "
        'engine\'s. `python -m pip install -e ".[test]"` here installs the pinned one; keep one venv per engine pin'
    )


@rank_zero_only
def warn_if_another_engine(project: Path) -> None:
    """Warn once (rank 0) when `project`'s pyproject.toml pins another engine commit than the one installed."""
    pyproject = project / "pyproject.toml"
    if pyproject.is_file() and (message := pin_mismatch(pyproject.read_text(encoding="utf-8"), installed_commit())):
        log.warning(message)
