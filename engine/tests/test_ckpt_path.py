"""What `ckpt_path` finds, and the resumes it refuses before anything is written."""

import logging
import shutil
import warnings

import pytest

from conftest import QUICK, files_written, in_process, read_json, run
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


def holds_a_run(run_dir) -> str:
    """The one line that refuses a new run in `run_dir`, a finished ONE_EPOCH run."""
    (best,) = (run_dir / "checkpoints").glob("best-*.ckpt")
    return (
        f"{run_dir} holds a run (checkpoints/{best.name}, checkpoints/last.ckpt, metrics.json): resume it with "
        "ckpt_path=last, or start a new run in another directory with hydra.run.dir=<new dir> (fresh_start=true "
        f"starts over here, moving its files to {run_dir}/replaced/<n>/ first)"
    )


@pytest.mark.slow  # an end-to-end run
def test_a_new_run_in_a_finished_runs_directory_is_refused_and_changes_nothing(one_epoch_run):
    """Without ckpt_path=last it would replace last.ckpt, metrics.json, plan.json and config.yaml and mix two runs'
    best checkpoints: one line naming both choices, exit 2, before anything is written, in process and at the entry
    point (a dry run, which would replace plan.json and config.yaml, too)."""
    before = files_written(one_epoch_run)
    with pytest.raises(UserError) as refused:
        in_process([*ONE_EPOCH, f"hydra.run.dir={one_epoch_run}"])
    assert str(refused.value) == holds_a_run(one_epoch_run)
    with pytest.raises(UserError, match=r"holds a run \(.*\), whose plan.json and config.yaml a dry run would replace"):
        in_process([*ONE_EPOCH, "dry_run=true", f"hydra.run.dir={one_epoch_run}"])
    result = run([*ONE_EPOCH, f"hydra.run.dir={one_epoch_run}"])
    assert (result.returncode, result.stderr) == (2, f"error: {holds_a_run(one_epoch_run)}\n")
    assert files_written(one_epoch_run) == before


@pytest.mark.slow  # end-to-end runs
def test_fresh_start_moves_the_earlier_run_aside_and_a_dry_runs_directory_is_reused(one_epoch_run, tmp_path):
    """fresh_start=true starts over in a directory that holds a run, its files first moved to replaced/1/ (the same
    bytes); a directory that only a dry run wrote into (plan.json, config.yaml) holds no run. With ckpt_path, which
    continues a run, fresh_start is refused."""
    run_dir = shutil.copytree(one_epoch_run, tmp_path / "run")
    earlier = files_written(run_dir)
    with pytest.raises(UserError, match=r"^fresh_start=true starts a run from scratch, ckpt_path=last continues one"):
        in_process([*ONE_EPOCH, "fresh_start=true", "ckpt_path=last", f"hydra.run.dir={run_dir}"])
    in_process([*ONE_EPOCH, "trainer.max_steps=2", "fresh_start=true", f"hydra.run.dir={run_dir}"])
    assert files_written(run_dir / "replaced" / "1") == earlier
    assert load_checkpoint(run_dir / "checkpoints/last.ckpt")["global_step"] == 2
    assert sorted(path.name for path in run_dir.iterdir()) == [
        ".hydra",
        "checkpoints",
        "config.yaml",
        "metrics.json",
        "plan.json",
        "replaced",
        "train.log",
    ]

    planned = tmp_path / "planned"
    in_process([*ONE_EPOCH, "dry_run=true", f"hydra.run.dir={planned}"])
    in_process([*ONE_EPOCH, "trainer.max_steps=2", f"hydra.run.dir={planned}"])
    assert load_checkpoint(planned / "checkpoints/last.ckpt")["global_step"] == 2


@pytest.mark.slow  # an end-to-end run
def test_a_resume_does_not_warn_that_its_checkpoint_directory_is_not_empty(one_epoch_run, tmp_path):
    """Lightning warns at every resume that the checkpoint directory is not empty: the engine resumed or refused
    such a directory before the Trainer was built."""
    run_dir = shutil.copytree(one_epoch_run, tmp_path / "run")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        in_process([*ONE_EPOCH, "trainer.max_epochs=2", "ckpt_path=last", f"hydra.run.dir={run_dir}"])
    assert not [w for w in caught if "Checkpoint directory" in str(w.message)]
    assert load_checkpoint(run_dir / "checkpoints/last.ckpt")["global_step"] == 38
