"""A future Lightning, simulated: each private name the engine relies on removed, and what a run does.

A correctness workaround refuses to start in one line naming the tested range; nothing fails at import.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import scaleup
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
    # The run's Trainer is built before the plan is written: nothing is written
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "plan.json").exists()


EVERY_PRIVATE = [private for workaround in gates.CORRECTNESS for private in workaround.needs]

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


UPSTREAM = ("torch", "lightning", "hydra", "optuna", "torchmetrics")
ENGINE = Path(scaleup.__file__).parent


def is_private(name: str) -> bool:
    """`_name`, but not a dunder nor a Hydra config key (`_target_`, `_partial_`)."""
    return name.startswith("_") and not name.startswith("__") and not re.fullmatch(r"_\w+_", name)


def on_self_or_super(node: ast.expr) -> bool:
    self_or_cls = isinstance(node, ast.Name) and node.id in ("self", "cls")
    return self_or_cls or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super")


def inherited_private(module: object, node: ast.ClassDef) -> set[str]:
    """The private names a class reads, writes or overrides (on `self`, `cls` or `super()`) that an upstream class it
    derives from defines, or assigns on `self` in its code."""
    cls = getattr(module, node.name, None)
    bases = [base for base in getattr(cls, "__mro__", ())[1:] if base.__module__.split(".")[0] in UPSTREAM]
    names = {item.name for item in node.body if isinstance(item, ast.FunctionDef) and is_private(item.name)}
    names |= {
        sub.attr for sub in ast.walk(node) if isinstance(sub, ast.Attribute) and on_self_or_super(sub.value)
    }  # fmt: skip
    sources = [inspect.getsource(base) for base in bases]
    return {
        name
        for name in names
        if is_private(name)
        and (any(name in vars(base) for base in bases) or any(f"self.{name}" in source for source in sources))
    }


def private_names_in_engine() -> dict[str, set[str]]:
    """Every private upstream name in the engine's source (see gates.PRIVATE_NAMES), with the files using it:
    `from x._y import`, `from x import _y`, `obj._name` or `getattr(obj, "_name")` on anything but
    `self`/`cls`/`super()` (and `sys`, `os`: Python's documented `sys._current_frames`, `os._exit`), and what
    `inherited_private` finds."""
    found: dict[str, set[str]] = {}
    for path in sorted(ENGINE.rglob("*.py")):
        where = path.relative_to(ENGINE).as_posix()
        tree = ast.parse(path.read_text())
        module = importlib.import_module(".".join(("scaleup", *path.relative_to(ENGINE).with_suffix("").parts)))
        names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in UPSTREAM:
                names |= {node.module} if any(map(is_private, node.module.split("."))) else set()
                names |= {alias.name for alias in node.names if is_private(alias.name)}
            elif isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names if any(map(is_private, alias.name.split(".")))}
            elif isinstance(node, ast.Attribute) and is_private(node.attr) and not on_self_or_super(node.value):
                if not (isinstance(node.value, ast.Name) and node.value.id in ("sys", "os")):
                    names.add(node.attr)
            elif isinstance(node, ast.ClassDef):
                names |= inherited_private(module, node)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id.endswith("attr"):
                named = node.args[1] if len(node.args) > 1 else None  # getattr(obj, "_name"), hasattr, setattr
                if isinstance(named, ast.Constant) and isinstance(named.value, str) and is_private(named.value):
                    names.add(named.value)
        for name in names:
            found.setdefault(name, set()).add(where)
    return found


def test_every_private_name_the_engine_touches_is_registered_with_its_canary():
    """A private name of torch, Lightning, Hydra, Optuna or torchmetrics used anywhere in the engine is listed in
    gates.PRIVATE_NAMES, with the file that uses it and a canary that exists; nothing listed is unused."""
    found = private_names_in_engine()
    assert sorted(found) == sorted(gates.PRIVATE_NAMES)
    tests = "\n".join(path.read_text() for path in Path(__file__).parent.glob("test_*.py"))
    for name, use in gates.PRIVATE_NAMES.items():
        assert found[name] == {use.where}, name
        assert f"def {use.canary}(" in tests, use.canary
    assert len(set(gates.PRIVATE_NAMES)) <= 11  # lower it as names go
