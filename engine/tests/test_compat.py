"""A future Lightning, simulated: each private name the engine relies on removed or changed, and what a run does.

A speed-only fast path steps aside with one warning and the run ends with the same metrics; a correctness
workaround refuses to start in one line naming the tested range; nothing fails at import. And the fast paths are
the template's only while its jobs run: a plain Lightning Trainer afterwards runs Lightning's own code.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import pytest

from conftest import ROOT, clean_env, in_process, read_json
from scaleup.compat import fast_paths, gates
from scaleup.errors import UserError

QUICK_RUN = ["trainer.max_epochs=1", "trainer.enable_progress_bar=false"]


def remove(monkeypatch: pytest.MonkeyPatch, private: gates.Private) -> None:
    """The private name gone, as a Lightning release without it would have it."""
    monkeypatch.delattr(*private.owner())


def change_signature(monkeypatch: pytest.MonkeyPatch, path: gates.Private) -> None:
    """The private function still there, with other parameters (it still does what it did)."""
    target, name = path.owner()
    original = getattr(target, name)
    monkeypatch.setattr(target, name, lambda *args, **kwargs: original(*args, **kwargs))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    in_process([*QUICK_RUN, f"hydra.run.dir={run_dir}"])
    return run_dir


@pytest.mark.slow  # an end-to-end run
def test_fast_paths_whose_private_code_changed_step_aside_with_the_same_results(
    reference, tmp_path, monkeypatch, caplog
):
    for path in fast_paths.FAST_PATHS:
        change_signature(monkeypatch, path.target)
    monkeypatch.setattr(fast_paths, "_warned", set())
    in_process([*QUICK_RUN, f"hydra.run.dir={tmp_path}"])
    off = [record.message for record in caplog.records if record.message.startswith("fast path off:")]
    assert len(off) == len(fast_paths.FAST_PATHS), off
    assert all("Lightning 2.6" in message and "results are the same" in message for message in off)
    results = [
        {k: v for k, v in read_json(run / "metrics.json").items() if not k.startswith("perf/")}
        for run in (tmp_path, reference)
    ]
    assert results[0] == results[1] and "test/acc" in results[0]


@pytest.mark.slow  # an end-to-end run
def test_a_plain_trainer_after_a_template_run_runs_lightnings_own_code(reference, tmp_path):
    """The reference run installed the fast paths around its fit and test, and removed them after."""
    from lightning.pytorch.trainer import call
    from lightning.pytorch.trainer.connectors.data_connector import _DataHookSelector
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

    assert call._call_callback_hooks.__module__ == "lightning.pytorch.trainer.call"
    assert _ResultMetric.to.__module__.startswith("lightning.") and "to" in vars(_ResultMetric)
    assert _DataHookSelector.get_instance.__module__.startswith("lightning.") and not fast_paths.active()

    class Idle(L.Callback):
        looked_up = 0

        def __getattribute__(self, name):
            if name == "on_train_batch_start":
                type(self).looked_up += 1
            return object.__getattribute__(self, name)

    from test_lightning_workarounds import Tiny

    L.Trainer(
        max_steps=2, callbacks=[Idle()], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        default_root_dir=tmp_path,
    ).fit(Tiny())  # fmt: skip
    assert Idle.looked_up == 2  # Lightning's dispatch calls every hook of every callback


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
    *(private for path in fast_paths.FAST_PATHS for private in path.workaround.needs),
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
