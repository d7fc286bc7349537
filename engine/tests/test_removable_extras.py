"""The extras are removable: with their files deleted from a copy of the engine, every other engine module imports
and a default dry run of the suite's project plans and exits 0 (docs/architecture.md#how-an-extra-joins-a-run). A core
module that still imported one of them, at its top or inside a function the dry run calls, fails here. They are deleted
together, in one process (an import of the engine costs seconds): one extra's import of another is test_layout's
static check to find."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_layout import ENGINE_SRC, EXTRAS, MACHINERY, REMOVABLE

from conftest import PROJECT, clean_env

pytestmark = pytest.mark.slow  # a process importing the engine

# The files of an extra outside the engine's package (its Hydra plugin).
OUTSIDE_THE_PACKAGE = {"search": ("hydra_plugins/scaleup_search",)}

# Run from the copy alone: an installed engine (an editable install's path) could otherwise stand in for a deleted
# module, and Hydra's plugin namespace package merges every `hydra_plugins` folder on the path.
WITHOUT_THE_EXTRA = """
import importlib, os, pkgutil, runpy, sys
copy, run_dir = sys.argv[1], sys.argv[2]
sys.path[:] = [p for p in sys.path if p == copy or not os.path.isdir(os.path.join(p or ".", "scaleup"))]
import scaleup
assert scaleup.__file__.startswith(copy), scaleup.__file__
for info in pkgutil.walk_packages(scaleup.__path__, "scaleup."):
    importlib.import_module(info.name)
sys.argv = ["train.py", "dry_run=true", f"hydra.run.dir={run_dir}"]
runpy.run_path("train.py", run_name="__main__")
# the auto batch size is registered (an entry point) but deleted: asking for it is one line, exit 2
sys.argv = ["train.py", "data.max_per_device_batch_size=auto", f"hydra.run.dir={run_dir}-auto"]
try:
    runpy.run_path("train.py", run_name="__main__")
except SystemExit as stop:
    print("auto exit", stop.code)
"""


def files_of(extra: str) -> list[Path]:
    """The files and folders (relative to engine/src) that make `extra`: its modules in test_layout.EXTRAS, and
    its files outside the package."""
    found = [Path(path) for path in OUTSIDE_THE_PACKAGE.get(extra, ())]
    for module in EXTRAS[extra]:
        path = Path(MACHINERY, *module.split("."))
        found.append(path if (ENGINE_SRC / path).is_dir() else path.with_suffix(".py"))
    assert all((ENGINE_SRC / path).exists() for path in found), found
    return found


def test_the_engine_runs_with_the_extras_deleted(tmp_path):
    copy = tmp_path / "src"
    shutil.copytree(ENGINE_SRC, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for path in (path for extra in REMOVABLE for path in files_of(extra)):
        if (copy / path).is_dir():
            shutil.rmtree(copy / path)
        else:
            (copy / path).unlink()
    env = clean_env(PYTHONPATH=f"{copy}:{PROJECT}")
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_THE_EXTRA, str(copy), str(tmp_path / "run")],
        cwd=PROJECT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "plan (dry run: nothing is started)" in done.stdout + done.stderr
    errors = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("error: ")]
    assert "auto exit 2" in done.stdout and errors == [
        "error: data.max_per_device_batch_size=auto: the part that settles it is not installed (no "
        "scaleup.per_device_caps entry point 'auto' loads; reinstall the engine: pip install -e ./engine); or give a "
        "number"
    ], done.stderr[-3000:]
