"""Resume, pre-emption and crash safety: a resumed run ends where the uninterrupted one does, in float64.

Each resumed run is compared with the shared uninterrupted baseline of its topology (conftest `baseline`): AdamW,
dropout 0.5 and random augmentation, so a resume must restore the optimizer's moments and draw the random
numbers the uninterrupted run drew. Step 13 is mid-epoch (5 of epoch 1's 8 steps) and mid-warmup (16 steps).
On one process both run in this process on one thread: the weights must be bitwise equal. Across processes or
device counts the reductions differ in order: equal to TOLERANCE (absolute).
"""

import logging
import os
import random
import re
import shutil
import sys
import time

import pytest

from conftest import (
    EXACT,
    EXACT_EPOCHS,
    EXACT_STEPS_PER_EPOCH,
    LR_TAG,
    QUICK,
    TOLERANCE,
    assert_same_weights,
    check,
    files_written,
    in_process,
    merged,
    read_json,
    run,
    save_every,
    scalars,
    start,
    training_epochs,
    weights,
)
from scaleup.checkpoints.io import load_checkpoint
from scaleup.checkpoints.resume import resolve_ckpt_path
from scaleup.errors import UserError

pytestmark = pytest.mark.slow

TOTAL_STEPS = EXACT_EPOCHS * EXACT_STEPS_PER_EPOCH  # 24
STOP_AFTER_2 = ["+callbacks.stop._target_=probes.StopAfterEpochs", "+callbacks.stop.epochs=2"]
# last.ckpt also every 5 steps, which no epoch end (8, 16, 24) is a multiple of: still written at every epoch's end.
EVERY_5 = "checkpoint.every_n_train_steps=5"


def lr_curve(run_dir):
    return scalars(run_dir, LR_TAG)


def last_weights(run_dir):
    return weights(run_dir / "checkpoints/last.ckpt")


def copied_run(source, tmp_path):
    """A copy of an interrupted run's directory, to resume with ckpt_path=last without touching the original."""
    return shutil.copytree(source, tmp_path / "run")


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """The baseline's 1-process run, stopped cleanly after 2 of its 3 epochs: last.ckpt at step 16 (an epoch
    end, though last.ckpt is also written every 5 steps), and batch-end checkpoints at steps 8 (the last batch of
    epoch 0) and 13 (mid-epoch 1) under steps/."""
    run_dir = tmp_path_factory.mktemp("interrupted") / "run"
    args = [*EXACT, EVERY_5, *STOP_AFTER_2, *save_every("at8", 8), *save_every("at13", 13)]
    in_process([*args, f"hydra.run.dir={run_dir}"])
    assert load_checkpoint(run_dir / "checkpoints/last.ckpt")["global_step"] == 16
    return run_dir


def test_float64_resume_is_bitwise_exact(baseline, interrupted, tmp_path):
    """Lightning loads the checkpoint into the module before its precision plugin casts it to float64; unless
    the module is built in float64, every resumed weight is rounded to float32 (~1e-7 off at the end). last.ckpt
    is the end of training (step 24, though also written every 5 steps), and the finished run, requeued once more,
    trains nothing and writes nothing."""
    resumed = copied_run(interrupted, tmp_path)
    args = [*EXACT, EVERY_5, "ckpt_path=last", f"hydra.run.dir={resumed}"]
    in_process(args)
    assert load_checkpoint(resumed / "checkpoints/last.ckpt")["global_step"] == TOTAL_STEPS
    assert_same_weights(last_weights(baseline("one")), last_weights(resumed), rtol=0, atol=0)
    assert lr_curve(resumed) == pytest.approx(lr_curve(baseline("one")), rel=1e-12)

    before = files_written(resumed)
    assert in_process(args) == read_json(resumed / "metrics.json")
    assert files_written(resumed) == before
    assert (
        f"the run already finished: {resumed}/checkpoints/last.ckpt is at its last step ({TOTAL_STEPS}) and its test "
        f"results are in {resumed}/metrics.json; nothing to do"
    ) in (resumed / "train.log").read_text()


def test_an_epoch_end_resume_with_max_steps_is_bitwise_exact(baseline, interrupted, tmp_path):
    """With trainer.max_steps set (the same 24 steps, so the same plan), Lightning 2.6 restarts a restored run inside
    its last epoch even when that epoch ran to its end: resumed from last.ckpt at step 16, it counted epoch 1's end
    twice and ended at step 16, having trained nothing (the fit loop of compat/lightning_2_6.py)."""
    in_process([*EXACT, f"trainer.max_steps={TOTAL_STEPS}", f"ckpt_path={interrupted}", f"hydra.run.dir={tmp_path}"])
    assert load_checkpoint(tmp_path / "checkpoints/last.ckpt")["global_step"] == TOTAL_STEPS
    assert_same_weights(last_weights(baseline("one")), last_weights(tmp_path), rtol=0, atol=0)
    assert lr_curve(tmp_path) == pytest.approx(
        {step: lr for step, lr in lr_curve(baseline("one")).items() if step >= 16}, rel=1e-12
    )


def test_a_run_that_max_steps_ended_mid_epoch_trains_on_exactly(tmp_path):
    """Ended by max_steps=21 two steps into epoch 1 (19 steps per epoch), trained on to max_steps=30 with
    ckpt_path=last: the rest of epoch 1, in its order, as the uninterrupted run to 30 (a constant LR, so that the
    21-step plan trains the first 21 steps as the 30-step one does). Lightning 2.6 counts epoch 1 as done there: the
    resume (max_epochs=2) ended at step 21, having trained nothing (LoopRepairs)."""
    run = [*QUICK, "logger=none", "callbacks=[]", "trainer.precision=64-true", "lr_schedule.decay=none"]
    in_process([*run, "trainer.max_steps=30", f"hydra.run.dir={tmp_path / 'uninterrupted'}"])
    in_process([*run, "trainer.max_steps=21", f"hydra.run.dir={tmp_path / 'further'}"])
    in_process([*run, "trainer.max_steps=30", "ckpt_path=last", f"hydra.run.dir={tmp_path / 'further'}"])
    assert load_checkpoint(tmp_path / "further/checkpoints/last.ckpt")["global_step"] == 30
    assert_same_weights(last_weights(tmp_path / "uninterrupted"), last_weights(tmp_path / "further"), rtol=0, atol=0)


def test_mid_epoch_resume_on_two_processes_equals_uninterrupted(baseline, tmp_path):
    """From the 2-process baseline's checkpoint at step 13 (5 of epoch 1's 8 steps), on 2 processes again. last.ckpt
    is the end of training (step 24, though also written every 5 steps), and the finished run, requeued on 2
    processes, trains nothing, writes nothing and exits 0."""
    ckpt = baseline("two") / "steps/at-13.ckpt"
    two = [*EXACT, EVERY_5, "trainer.devices=2", f"hydra.run.dir={tmp_path}"]
    check(run([*two, f"ckpt_path={ckpt}"]))
    assert read_json(tmp_path / "plan.json")["world_size"] == 2
    assert load_checkpoint(tmp_path / "checkpoints/last.ckpt")["global_step"] == TOTAL_STEPS
    worst = assert_same_weights(last_weights(baseline("two")), last_weights(tmp_path), rtol=0, atol=TOLERANCE)
    print(f"2 processes: resumed vs uninterrupted, largest weight difference {worst:.1e}")
    assert lr_curve(tmp_path) == pytest.approx(
        {step: lr for step, lr in lr_curve(baseline("two")).items() if step >= 13}, rel=1e-12
    )
    # Each rank continues its own share of epoch 1's sums: the epoch's figures are the uninterrupted run's.
    resumed, uninterrupted = training_epochs(tmp_path), training_epochs(baseline("two"))
    for tag, values in resumed.items():
        assert values == pytest.approx({15: uninterrupted[tag][15], 23: uninterrupted[tag][23]}, rel=1e-12), tag

    before = files_written(tmp_path)
    requeued = check(run([*two, "ckpt_path=last"]))
    assert files_written(tmp_path) == before
    assert "the run already finished" in requeued.stdout + requeued.stderr


def test_resume_on_another_device_count_keeps_the_plan_and_the_result(baseline, tmp_path):
    """2 processes for 2 epochs, then 1 process for the last: the same global batches, so the same weights as
    the uninterrupted 1-process run."""
    in_process(
        [*EXACT, "trainer.devices=1", f"ckpt_path={baseline('two') / 'steps/at-16.ckpt'}", f"hydra.run.dir={tmp_path}"]
    )
    log = (tmp_path / "train.log").read_text()
    assert "world_size 2 -> 1" in log and "accumulate_grad_batches 1 -> 2" in log  # micro-batches of 32 on both
    assert "changes the recipe" not in log  # the topology's changes only
    assert load_checkpoint(tmp_path / "checkpoints/last.ckpt")["global_step"] == TOTAL_STEPS
    assert read_json(tmp_path / "plan.json")["global_batch_size"] == 64
    worst = assert_same_weights(last_weights(baseline("one")), last_weights(tmp_path), rtol=0, atol=TOLERANCE)
    print(f"2 processes then 1: largest weight difference from 1 process throughout {worst:.1e}")


def test_a_resume_with_another_lr_warns_naming_what_changed(interrupted, tmp_path, caplog):
    """A resume that leaves out an override of the run's start (here its LR: model.optimizer.lr 1e-3 then, 2e-3 now)
    trains on with another recipe: a warning names each changed value of the plan. Before: only the info line."""
    with caplog.at_level(logging.INFO, logger="scaleup"):
        in_process(
            [
                *EXACT,
                "model.optimizer.lr=2e-3",
                f"ckpt_path={interrupted / 'checkpoints/last.ckpt'}",
                f"hydra.run.dir={tmp_path}",
            ]
        )
    last = interrupted / "checkpoints/last.ckpt"
    resume = [(record.levelname, record.getMessage()) for record in caplog.records if record.module == "resume"]
    assert resume == [
        ("INFO", f"resuming from {last}"),  # the same topology: nothing else changed
        (
            "WARNING",
            f"the resume changes the recipe {last} trained with: base_lrs {{AdamW/decay: 0.001, AdamW/no_decay: "
            "0.001} -> {AdamW/decay: 0.002, AdamW/no_decay: 0.002}, base_lr 0.001 -> 0.002, lr 0.002 -> 0.004. If "
            "the run started with overrides, pass them again (this run's config.yaml and plan.json now hold the new "
            "values)",
        ),
    ]


def test_mid_epoch_checkpoint_resumes_exactly(baseline, interrupted, tmp_path):
    """Step 13 is 5 of epoch 1's 8 steps, and in the warmup: the sampler must skip exactly the batches already
    trained on, and the LR, the moments and the random numbers continue where they were."""
    in_process([*EXACT, f"ckpt_path={interrupted / 'steps/at-13.ckpt'}", f"hydra.run.dir={tmp_path}"])
    assert_same_weights(last_weights(baseline("one")), last_weights(tmp_path), rtol=0, atol=0)
    # The resumed epoch's figures cover all of it (its first 5 steps' sums came with the checkpoint), bit for bit:
    # epoch 1 (logged at step 15) counts its 512 samples, not the 192 trained after the resume.
    uninterrupted = training_epochs(baseline("one"))
    assert uninterrupted["samples"] == {7: 512, 15: 512, 23: 512}  # logged at the last step of each epoch (0-based)
    assert training_epochs(tmp_path) == {tag: {15: v[15], 23: v[23]} for tag, v in uninterrupted.items()}


def test_resume_twice_at_epoch_ends_trains_no_extra_epoch(baseline, interrupted, tmp_path):
    """Resume from the last batch of epoch 0, save at the last batch of epoch 1, resume again. Without
    LoopRepairs, Lightning 2.6 trains epoch 1 a second time here (32 steps instead of 24)."""
    second = tmp_path / "second"
    in_process(
        [
            *EXACT,
            *save_every("at16", 16, second),
            f"ckpt_path={interrupted / 'steps/at-8.ckpt'}",
            f"hydra.run.dir={second}",
        ]
    )
    in_process([*EXACT, f"ckpt_path={second / 'at-16.ckpt'}", f"hydra.run.dir={tmp_path / 'third'}"])
    assert load_checkpoint(tmp_path / "third/checkpoints/last.ckpt")["global_step"] == TOTAL_STEPS
    assert_same_weights(last_weights(baseline("one")), last_weights(tmp_path / "third"), rtol=0, atol=0)


def test_sigterm_saves_stops_cleanly_and_resumes_exactly(baseline, tmp_path):
    """A real SIGTERM to train.py after micro-batch 10 of epoch 1, the first of step 5's two (the process sends it
    to itself, at a known point): saved at the end of step 4 (13 in all), the resume replays step 5 whole."""
    sigterm = ["+callbacks.sigterm._target_=probes.SigtermAtBatch", "+callbacks.sigterm.epoch=1"]
    result = run([*EXACT, *sigterm, "+callbacks.sigterm.batch_idx=10", f"hydra.run.dir={tmp_path}"])
    output = result.stdout + result.stderr
    assert result.returncode == 143, output
    assert f"resume with: python train.py ckpt_path=last hydra.run.dir={tmp_path}" in output
    assert "Traceback" not in output
    assert load_checkpoint(tmp_path / "checkpoints/last.ckpt")["global_step"] == 13
    in_process([*EXACT, "ckpt_path=last", f"hydra.run.dir={tmp_path}"])
    assert_same_weights(last_weights(baseline("one")), last_weights(tmp_path), rtol=0, atol=0)


def wait_for_save(path, previous_mtime, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while not path.exists() or path.stat().st_mtime_ns == previous_mtime:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_kill_9_never_leaves_a_broken_last_checkpoint(tmp_path):
    """kill -9 at random moments of a run that rewrites last.ckpt every step; each restart resumes from it.

    2 kills: each one lands somewhere in a stream of saves and must leave a complete last.ckpt that the next
    start continues from (test_checkpoint kills a bare writer 10 times in the middle of its saves).
    """
    rng = random.Random(0)
    last = tmp_path / "checkpoints/last.ckpt"
    every_step = ["checkpoint.every_n_train_steps=1", "trainer.max_epochs=20"]
    args = [
        *QUICK,
        *every_step,
        "data.val_size=129",
        "data.test_size=1155",
        "ckpt_path=last",
        f"hydra.run.dir={tmp_path}",
    ]
    steps = []
    for _ in range(2):
        saved_before = last.stat().st_mtime_ns if last.exists() else None
        proc = start([sys.executable, "train.py", *merged(args)])
        wait_for_save(last, saved_before, proc)  # training (and saving every step) is under way again
        time.sleep(rng.uniform(0.0, 1.0))
        proc.kill()
        proc.wait()
        steps.append(load_checkpoint(last)["global_step"])  # loads in full: never truncated
    assert steps == sorted(steps) and steps[-1] > steps[0]  # every restart continued from the previous save
    print(f"killed at steps {steps}")
    in_process([*args, "checkpoint.every_n_train_steps=null"])  # and the run completes
    assert load_checkpoint(last)["global_step"] == 20 * EXACT_STEPS_PER_EPOCH
    assert not list(last.parent.glob(".*.tmp"))  # interrupted writes cleaned up by the next run


def test_resume_with_another_network_is_refused_and_changes_nothing(baseline, tmp_path):
    previous = copied_run(baseline("one"), tmp_path)
    before = {p: p.read_bytes() for p in [previous / "plan.json", previous / "checkpoints/last.ckpt"]}
    with pytest.raises(UserError, match=r"model\.net\.width=32"):  # the refusal; its text is test_errors'
        in_process(
            [*EXACT, "trainer.max_epochs=4", "model.net.width=16", "ckpt_path=last", f"hydra.run.dir={previous}"]
        )
    assert {p: p.read_bytes() for p in before} == before


@pytest.mark.parametrize("job", ["train", "eval"])
def test_truncated_checkpoint_is_one_clear_message(baseline, tmp_path, job):
    """A resume (train) or an evaluation of a truncated checkpoint is refused naming the file; test_errors checks
    the message and that the entry points print it as one line, with exit code 2."""
    broken = tmp_path / "broken.ckpt"
    data = (baseline("one") / "checkpoints/last.ckpt").read_bytes()
    broken.write_bytes(data[: len(data) // 3])
    with pytest.raises(UserError, match=re.escape(str(broken))):
        in_process([f"ckpt_path={broken}", f"hydra.run.dir={tmp_path / job}"], job=job)


def test_bf16_and_compiled_checkpoint_evaluates_on_cpu(tmp_path):
    trained = in_process(
        [
            *QUICK,
            "trainer.max_epochs=1",
            "trainer.precision=bf16-mixed",
            "model.compile=true",
            "data.val_size=192",  # whole batches of 64 everywhere: one compiled shape per stage, no recompile
            "data.test_size=320",
            f"hydra.run.dir={tmp_path}",
        ]
    )
    ckpt = next((tmp_path / "checkpoints").glob("best-*.ckpt"))
    assert not [k for k in weights(ckpt) if "_orig_mod" in k or k.startswith("module.")]
    evaluated = in_process(
        [f"ckpt_path={ckpt}", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path / 'eval'}"], job="eval"
    )
    assert evaluated["test/acc"] == trained["test/acc"]


def test_last_is_the_newer_of_last_ckpt_and_an_hpc_checkpoint(tmp_path):
    """On SLURM's pre-emption signal Lightning saves hpc_ckpt_<N>.ckpt in the run directory, not last.ckpt:
    ckpt_path=last takes whichever of them was written last."""
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    last, hpc = checkpoints / "last.ckpt", tmp_path / "hpc_ckpt_2.ckpt"
    for path, written in ((last, 1_000), (hpc, 2_000), (tmp_path / "hpc_ckpt_1.ckpt", 500)):
        path.write_bytes(b"x")
        os.utime(path, ns=(written * 10**9, written * 10**9))
    assert resolve_ckpt_path("last", str(checkpoints), tmp_path) == hpc
    os.utime(last, ns=(3_000 * 10**9, 3_000 * 10**9))  # an epoch end after the requeue rewrote last.ckpt
    assert resolve_ckpt_path("last", str(checkpoints), tmp_path) == last
