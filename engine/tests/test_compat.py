"""A future Lightning, simulated: each private name the engine relies on removed, and what a run does.

A correctness workaround refuses to start in one line naming the tested range; nothing fails at import.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, clean_env, in_process
from scaleup.compat import gates
from scaleup.errors import UserError

QUICK_RUN = ["trainer.max_epochs=1", "trainer.enable_progress_bar=false"]


def remove(monkeypatch: pytest.MonkeyPatch, private: gates.Private) -> None:
    """The private name gone, as a Lightning release without it would have it."""
    monkeypatch.delattr(*private.owner())


@pytest.mark.parametrize("workaround", gates.CORRECTNESS, ids=lambda w: w.name.split(" (")[0])
def test_correctness_workarounds_refuse_in_one_line_when_their_private_code_is_gone(monkeypatch, workaround):
    assert workaround.problem() is None  # the installed Lightning is the tested one
    for private in workaround.needs:
        with monkeypatch.context() as patched:
            remove(patched, private)
            with pytest.raises(UserError) as refused:
                gates.require(workaround)
        message = str(refused.value)
        assert "\n" not in message and f"{private.path} is gone" in message
        assert gates.TESTED in message and gates.INSTALL_TESTED in message


def test_a_training_run_refuses_before_fit(monkeypatch, tmp_path):
    remove(monkeypatch, gates.EXACT_EVAL.needs[1])  # _ResultMetric
    with pytest.raises(UserError, match=r"^exact evaluation metrics \(ExactEvalMetrics\) relies on Lightning"):
        in_process([*QUICK_RUN, f"hydra.run.dir={tmp_path}"])
    assert not (tmp_path / "checkpoints").exists() and (tmp_path / "plan.json").is_file()


EVERY_PRIVATE = [
    *(private for workaround in gates.CORRECTNESS for private in workaround.needs),
    *gates.WITH_FALLBACK,
]

WITHOUT_PRIVATE_NAMES = """
import importlib, json, pkgutil, runpy, sys
from scaleup.compat.gates import Private
paths, run_dir = json.loads(sys.argv[1]), sys.argv[2]
for path in paths:
    target, name = Private(path).owner()
    if name in vars(target):
        delattr(target, name)
import scaleup
for info in pkgutil.walk_packages(scaleup.__path__, "scaleup."):
    if info.name != "scaleup.check_equivalence":  # a job run with `python -m`: imported by the loop below too
        importlib.import_module(info.name)
importlib.import_module("scaleup.check_equivalence")
for args in (["dry_run=true"], ["trainer.max_epochs=1", "trainer.enable_progress_bar=false"]):
    sys.argv = ["train.py", *args, f"hydra.run.dir={run_dir}"]
    try:
        runpy.run_path("train.py", run_name="__main__")
        print("EXIT 0", flush=True)
    except SystemExit as stopped:
        print(f"EXIT {stopped.code}", flush=True)
"""


@pytest.mark.slow
def test_without_any_private_name_the_engine_imports_plans_and_refuses_to_train_in_one_line(tmp_path):
    """Every private name removed at once: every engine module imports, a dry run plans, a training run is
    refused in one line with exit code 2."""
    # Deepest first: a class's attributes before the class.
    paths = json.dumps(sorted({private.path for private in EVERY_PRIVATE}, key=lambda path: -path.count(".")))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(WITHOUT_PRIVATE_NAMES), paths, str(tmp_path / "run")],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line for line in done.stdout.splitlines() if line.startswith("EXIT")] == ["EXIT 0", "EXIT 2"], done.stdout
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "relies on Lightning internals that changed" in errors[0], done.stderr[-2000:]
