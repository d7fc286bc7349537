"""What `ckpt_path` finds, and the resumes it refuses before anything is written."""

import logging
import shutil

import pytest

from conftest import QUICK, in_process, read_json
from scaleup.checkpoints.io import load_checkpoint
from scaleup.errors import UserError

ONE_EPOCH = [*QUICK, "trainer.max_epochs=1", "logger=none", "callbacks=[]"]


@pytest.fixture(scope="module")
def one_epoch_run(tmp_path_factory):
    """A finished 1-epoch run (19 steps of 64)."""
    run_dir = tmp_path_factory.mktemp("one-epoch") / "run"
    in_process([*ONE_EPOCH, f"hydra.run.dir={run_dir}"])
    return run_dir


@pytest.mark.slow  # an end-to-end run
def test_last_in_a_new_directory_starts_fresh_and_says_how_to_resume_another(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="scaleup"):
        in_process([*ONE_EPOCH, "trainer.max_steps=2", "ckpt_path=last", f"hydra.run.dir={tmp_path}"])
    assert f"ckpt_path=last: no checkpoint in {tmp_path}/checkpoints yet, starting a new run there" in caplog.text
    assert "hydra.run.dir=<run dir>" in caplog.text


@pytest.mark.slow  # an end-to-end run
def test_last_refuses_a_directory_with_an_earlier_run_but_no_last_checkpoint(one_epoch_run, tmp_path):
    """A new best beside a stale one, or a new plan over the old one, would mix two runs: refused, nothing written."""
    (one_epoch_run / "checkpoints" / "last.ckpt").rename(tmp_path / "last.ckpt")
    before = read_json(one_epoch_run / "plan.json")
    try:
        with pytest.raises(UserError, match=r"holds an earlier run \(metrics\.json, checkpoints/best-"):
            in_process([*ONE_EPOCH, "trainer.max_epochs=2", "ckpt_path=last", f"hydra.run.dir={one_epoch_run}"])
        assert read_json(one_epoch_run / "plan.json") == before
    finally:
        (tmp_path / "last.ckpt").rename(one_epoch_run / "checkpoints" / "last.ckpt")


@pytest.mark.slow  # an end-to-end run
def test_a_resume_with_another_global_batch_is_refused(one_epoch_run, tmp_path):
    """Its steps, epoch and LR schedule count batches of 64: a resume at 32 would plan a run that does not happen."""
    with pytest.raises(UserError) as refused:
        in_process(
            [
                *ONE_EPOCH,
                "trainer.max_epochs=3",
                "data.global_batch_size=32",
                f"ckpt_path={one_epoch_run}",  # the run directory: its last.ckpt
                f"hydra.run.dir={tmp_path}",
            ]
        )
    assert str(refused.value) == (
        f"{one_epoch_run}/checkpoints/last.ckpt trained 19 steps with a global batch of 64 (1216 samples), this "
        "run's is 32: its steps, epoch and LR schedule count batches of 64. Resume with data.global_batch_size=64 "
        "data.per_device_batch_size=null (any device count keeps it), or start a new run from these weights: "
        f"init.weights={one_epoch_run}/checkpoints/last.ckpt"
    )
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.slow
def test_a_run_trained_further_and_stopped_before_its_test_runs_that_test_when_requeued(one_epoch_run, tmp_path):
    """Trained on to 2 epochs: the first fit's test results are not those of these weights. Fit drops them, so after
    a pre-emption between fit and the new test, the requeue runs that test instead of taking the run for finished."""
    run_dir = shutil.copytree(one_epoch_run, tmp_path / "run")
    further = [*ONE_EPOCH, "trainer.max_epochs=2", "ckpt_path=last", f"hydra.run.dir={run_dir}"]
    with pytest.raises(SystemExit) as stopped:
        in_process([*further, "+callbacks={sigterm:{_target_:probes.SigtermAfterFit,rank:0}}"])  # beside callbacks=[]
    assert stopped.value.code == 143
    assert load_checkpoint(run_dir / "checkpoints/last.ckpt")["global_step"] == 38
    assert not [name for name in read_json(run_dir / "metrics.json") if name.startswith("test/")]
    assert in_process(further)["test/samples"] == 360
    assert "last.ckpt finished training at step 38: running its test" in (run_dir / "train.log").read_text()
