"""Resume, preemption and crash safety with real processes: checkpoints that survive anything."""

import json
import random
import shutil
import signal
import sys
import time

import pytest

from conftest import QUICK, assert_same_weights, check, merged, read_json, run, start, weights
from scaleup.engine.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow

# 8 optimizer steps per epoch (513 training samples, global batch 64), 4 epochs.
SMALL = [*QUICK, "trainer.max_epochs=4", "data.val_size=129", "data.test_size=1155", "trainer.log_every_n_steps=1"]
STOP_AFTER_2 = ["+callbacks.stop._target_=probes.StopAfterEpochs", "+callbacks.stop.epochs=2"]


def lr_curve(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {e.step: e.value for e in events.Scalars("lr-SGD/decay")}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Uninterrupted 4-epoch runs on 1 and 2 devices."""
    root = tmp_path_factory.mktemp("straight")
    for devices in (1, 2):
        check(run([*SMALL, f"trainer.devices={devices}", f"hydra.run.dir={root / str(devices)}"]))
    return root


@pytest.mark.parametrize("devices", [1, 2])
def test_interrupted_then_resumed_equals_uninterrupted(straight, tmp_path, devices):
    args = [*SMALL, f"trainer.devices={devices}", f"hydra.run.dir={tmp_path}"]
    check(run([*args, *STOP_AFTER_2]))
    assert load_checkpoint(tmp_path / "checkpoints/last.ckpt")["global_step"] == 16
    check(run([*args, "ckpt_path=last"]))
    worst = assert_same_weights(
        weights(straight / str(devices) / "checkpoints/last.ckpt"),
        weights(tmp_path / "checkpoints/last.ckpt"),
        rtol=1e-6,
        atol=1e-7,
    )
    print(f"{devices} device(s): resumed vs uninterrupted, largest weight difference {worst:.1e}")
    assert lr_curve(tmp_path) == pytest.approx(lr_curve(straight / str(devices)), rel=1e-6)


def test_mid_epoch_checkpoint_resumes_exactly(straight, tmp_path):
    steps = tmp_path / "steps"
    save_at_step_13 = [
        "+callbacks.steps._target_=lightning.pytorch.callbacks.ModelCheckpoint",
        f"+callbacks.steps.dirpath={steps}",
        "+callbacks.steps.every_n_train_steps=13",
        "+callbacks.steps.save_top_k=-1",
        "+callbacks.steps.filename='at-{step}'",
    ]
    check(run([*SMALL, *save_at_step_13, *STOP_AFTER_2, f"hydra.run.dir={tmp_path / 'first'}"]))
    mid_epoch = tmp_path / "step13.ckpt"  # 13 = epoch 1, 5 of its 8 steps done
    shutil.copy(steps / "at-step=13.ckpt", mid_epoch)
    check(run([*SMALL, f"ckpt_path={mid_epoch}", f"hydra.run.dir={tmp_path / 'resumed'}"]))
    assert_same_weights(
        weights(straight / "1/checkpoints/last.ckpt"), weights(tmp_path / "resumed/checkpoints/last.ckpt"), 0, 0
    )


def save_every(steps_dir, n):
    return [
        "+callbacks.steps._target_=lightning.pytorch.callbacks.ModelCheckpoint",
        f"+callbacks.steps.dirpath={steps_dir}",
        f"+callbacks.steps.every_n_train_steps={n}",
        "+callbacks.steps.save_top_k=-1",
        "+callbacks.steps.filename='at-{step}'",
    ]


def test_resume_twice_at_epoch_ends_trains_no_extra_epoch(straight, tmp_path):
    """Resume from the last batch of epoch 0, save at the last batch of epoch 1, resume again. Without
    EpochProgressRepair, Lightning 2.6 trains epoch 1 a second time here (40 steps instead of 32)."""
    first, second = tmp_path / "first", tmp_path / "second"
    check(
        run(
            [
                *SMALL,
                *save_every(first, 8),
                "+callbacks.stop._target_=probes.StopAfterEpochs",
                "+callbacks.stop.epochs=1",
                f"hydra.run.dir={first}",
            ]
        )
    )
    shutil.copy(first / "at-step=8.ckpt", tmp_path / "step8.ckpt")
    check(run([*SMALL, *save_every(second, 16), f"ckpt_path={tmp_path / 'step8.ckpt'}", f"hydra.run.dir={second}"]))
    shutil.copy(second / "at-step=16.ckpt", tmp_path / "step16.ckpt")
    check(run([*SMALL, f"ckpt_path={tmp_path / 'step16.ckpt'}", f"hydra.run.dir={tmp_path / 'third'}"]))
    assert load_checkpoint(tmp_path / "third/checkpoints/last.ckpt")["global_step"] == 32
    assert_same_weights(
        weights(straight / "1/checkpoints/last.ckpt"), weights(tmp_path / "third/checkpoints/last.ckpt"), 0, 0
    )


def test_resume_on_another_device_count_keeps_the_plan(tmp_path):
    check(run([*SMALL, "trainer.devices=2", f"hydra.run.dir={tmp_path}", *STOP_AFTER_2]))
    result = check(run([*SMALL, "trainer.devices=1", "ckpt_path=last", f"hydra.run.dir={tmp_path}"]))
    assert "world_size 2 -> 1" in result.stderr + result.stdout and "per_device_batch_size 32 -> 64" in (
        result.stderr + result.stdout
    )
    assert load_checkpoint(tmp_path / "checkpoints/last.ckpt")["global_step"] == 32
    assert read_json(tmp_path / "plan.json")["global_batch_size"] == 64


def start_training(args):
    return start([sys.executable, "train.py", *merged(args)])


def wait_for(path, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def wait_for_save(path, previous_mtime, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while not path.exists() or path.stat().st_mtime_ns == previous_mtime:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_sigterm_saves_stops_cleanly_and_resumes_exactly(straight, tmp_path):
    last = tmp_path / "checkpoints/last.ckpt"
    proc = start_training([*SMALL, f"hydra.run.dir={tmp_path}"])
    wait_for(last, proc)  # first epoch done: now in the middle of training
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, output
    assert f"resume with: python train.py ckpt_path=last hydra.run.dir={tmp_path}" in output
    assert "Traceback" not in output
    stopped_at = load_checkpoint(last)["global_step"]
    assert 8 <= stopped_at < 32
    check(run([*SMALL, "ckpt_path=last", f"hydra.run.dir={tmp_path}"]))
    assert_same_weights(weights(straight / "1/checkpoints/last.ckpt"), weights(last), 0, 0)
    print(f"SIGTERM at step {stopped_at}: resumed run equals the uninterrupted one exactly")


def test_kill_9_never_leaves_a_broken_last_checkpoint(tmp_path):
    """kill -9 at random moments of a run that rewrites last.ckpt every step; each restart resumes from it."""
    rng = random.Random(0)
    last = tmp_path / "checkpoints/last.ckpt"
    every_step = ["callbacks.last_checkpoint.every_n_train_steps=1", "trainer.max_epochs=40"]
    args = [*SMALL, *every_step, "ckpt_path=last", f"hydra.run.dir={tmp_path}"]
    report = []
    for trial in range(10):
        saved_before = last.stat().st_mtime_ns if last.exists() else None
        proc = start_training(args)
        wait_for_save(last, saved_before, proc)  # training (and saving every step) is under way again
        time.sleep(rng.uniform(0.0, 1.0))
        proc.kill()
        proc.wait()
        step = load_checkpoint(last)["global_step"]  # loads in full: never truncated
        leftovers = sorted(p.name for p in last.parent.iterdir() if p.name != "last.ckpt" and "best" not in p.name)
        report.append({"trial": trial, "global_step": step, "temp_files_left": leftovers})
    steps = [r["global_step"] for r in report]
    assert steps == sorted(steps) and steps[-1] > steps[0]  # every restart continued from the previous save
    print(json.dumps(report))
    check(run([*args, "callbacks.last_checkpoint.every_n_train_steps=null"]))  # and the run completes
    assert load_checkpoint(last)["global_step"] == 40 * 8
    assert not list(last.parent.glob(".*.tmp"))  # interrupted writes cleaned up by the next run


def test_resume_with_another_network_is_refused_and_changes_nothing(tmp_path):
    check(run([*QUICK, "trainer.max_epochs=1", f"hydra.run.dir={tmp_path}"]))
    before = {p: p.read_bytes() for p in [tmp_path / "plan.json", tmp_path / "checkpoints/last.ckpt"]}
    result = run([*QUICK, "model.net.width=16", "ckpt_path=last", f"hydra.run.dir={tmp_path}"], timeout=60)
    assert result.returncode == 2
    assert "was trained with another network: model.net.width=32 (now 16)" in result.stderr
    assert "Traceback" not in result.stderr
    assert {p: p.read_bytes() for p in before} == before


def test_truncated_checkpoint_is_one_clear_message(tmp_path):
    check(run([*QUICK, "trainer.max_epochs=1", f"hydra.run.dir={tmp_path}"]))
    broken = tmp_path / "broken.ckpt"
    data = (tmp_path / "checkpoints/last.ckpt").read_bytes()
    broken.write_bytes(data[: len(data) // 3])
    for script in ("eval.py", "train.py"):
        result = run([f"ckpt_path={broken}", f"hydra.run.dir={tmp_path / script}"], script=script, timeout=60)
        assert result.returncode == 2, script
        assert "is not a readable checkpoint: truncated or corrupt" in result.stderr.splitlines()[-1]


def test_bf16_and_compiled_checkpoint_evaluates_on_cpu(tmp_path):
    result = check(
        run(
            [
                *QUICK,
                "trainer.max_epochs=1",
                "trainer.precision=bf16-mixed",
                "model.compile=true",
                f"hydra.run.dir={tmp_path}",
            ]
        )
    )
    assert result.returncode == 0
    ckpt = next((tmp_path / "checkpoints").glob("best-*.ckpt"))
    assert not [k for k in weights(ckpt) if "_orig_mod" in k or k.startswith("module.")]
    check(
        run(
            [f"ckpt_path={ckpt}", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path / 'eval'}"],
            script="eval.py",
        )
    )
    assert read_json(tmp_path / "eval/metrics.json")["test/acc"] == read_json(tmp_path / "metrics.json")["test/acc"]
