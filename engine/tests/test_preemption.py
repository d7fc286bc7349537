"""SIGTERM anywhere (training, validation, the final test, eval.py): every rank stops, exit code 143, never 0
without results, and the requeued `ckpt_path=last` run completes.

The signal comes from the data: probes.SigtermDigits sends SIGTERM to the process that loads sample 130 of the
chosen split (once: a marker file remembers), so it lands at a known point of that phase, in whichever rank
loads the sample. On 2 processes the test split's sample 131 is rank 1's (unpadded shards: rank r gets r, r + 2,
...): a signal that reaches one rank alone, as a pre-empted pod's does, which rank 0 must learn of before the
test's metric collectives.
"""

import signal
import subprocess
import sys

import pytest
import torch

from conftest import QUICK, check, in_process, read_json, start

pytestmark = pytest.mark.slow

RUN = [*QUICK, "logger=none", "callbacks=[]"]
STEPS_PER_EPOCH = 19  # 1,257 training samples, global batch 64
# A signal in epoch 0's validation needs a second epoch to stop in; in training or in the test, one epoch will do.
EPOCHS = {"train": 1, "val": 2, "test": 1}


def sigterm_in(split: str, tmp_path, plus: str = "", index: int = 130) -> list[str]:
    epochs = [] if plus else [f"trainer.max_epochs={EPOCHS[split]}"]  # eval.py trains nothing
    return [
        *epochs,
        f"{plus}data._target_=probes.SigtermDigits",
        f"+data.split={split}",
        f"+data.index={index}",
        f"+data.marker={tmp_path / 'signalled'}",
    ]


# Rank 1 alone signalled: in the test (its sample 131), or when fit has ended (before the test starts).
RANK_1_IN_TEST = {"index": 131}
RANK_1_AFTER_FIT = ["+callbacks={sigterm:{_target_:probes.SigtermAfterFit,rank:1}}"]  # beside callbacks=[]


def has_test_results(run_dir) -> bool:
    return (run_dir / "metrics.json").is_file() and "test/acc" in read_json(run_dir / "metrics.json")


def last_step(run_dir) -> int:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]


# A signal during validation stops training after the next step; during the final test, with the steps all done.
@pytest.mark.parametrize(("phase", "stopped_at"), [("val", STEPS_PER_EPOCH + 1), ("test", STEPS_PER_EPOCH)])
def test_one_process_stops_with_143_and_the_requeued_run_completes(phase, stopped_at, tmp_path):
    """Validation runs to its end and training stops after the next step (writing last.ckpt there); a signal in
    the final test leaves no test results and exit 143, and the requeue runs just the test."""
    args = [*RUN, *sigterm_in(phase, tmp_path), f"hydra.run.dir={tmp_path / 'run'}"]
    with pytest.raises(SystemExit) as stopped:
        in_process(args)
    assert stopped.value.code == 143
    assert last_step(tmp_path / "run") == stopped_at
    assert not has_test_results(tmp_path / "run")
    metrics = in_process([*args, "ckpt_path=last"])
    assert metrics["test/samples"] == 360 and last_step(tmp_path / "run") == EPOCHS[phase] * STEPS_PER_EPOCH


def test_eval_on_one_process_stops_with_143_and_writes_no_metrics(trained_run, tmp_path):
    (best,) = (trained_run / "checkpoints").glob("best-*.ckpt")
    args = [f"ckpt_path={best}", *sigterm_in("test", tmp_path, plus="+"), f"hydra.run.dir={tmp_path / 'eval'}"]
    with pytest.raises(SystemExit) as stopped:
        in_process(args, job="eval")
    assert stopped.value.code == 143
    assert not (tmp_path / "eval" / "metrics.json").exists()


def finished(proc: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(proc.args, proc.wait(timeout), proc.communicate()[0])


def test_two_processes_stop_together_in_every_phase_and_resume(trained_run, tmp_path):
    """On 2 processes, SIGTERM in training (in whichever rank loads the sample), in validation, and to rank 1
    alone in the final test, between fit and test, and in eval.py: both ranks stop, within the timeout, with exit
    143 and no traceback; the requeued test completes."""
    two = ["trainer.devices=2"]
    runs = {phase: tmp_path / phase for phase in ("train", "val", "test", "after_fit")}
    signals = {
        "train": sigterm_in("train", runs["train"]),
        "val": sigterm_in("val", runs["val"]),
        "test": sigterm_in("test", runs["test"], **RANK_1_IN_TEST),
        "after_fit": ["trainer.max_epochs=1", *RANK_1_AFTER_FIT],
    }
    train = {phase: [*RUN, *two, *signals[phase], f"hydra.run.dir={run_dir}"] for phase, run_dir in runs.items()}
    procs = {phase: start([sys.executable, "train.py", *args]) for phase, args in train.items()}
    (best,) = (trained_run / "checkpoints").glob("best-*.ckpt")
    eval_dir = tmp_path / "eval"
    eval_signal = sigterm_in("test", eval_dir, plus="+", **RANK_1_IN_TEST)
    procs["eval"] = start(
        [sys.executable, "eval.py", f"ckpt_path={best}", *two, *eval_signal, f"hydra.run.dir={eval_dir}"]
    )
    results = {phase: finished(proc) for phase, proc in procs.items()}
    for phase, result in results.items():
        assert result.returncode == 143, f"{phase}: exit {result.returncode}\n{result.stdout[-3000:]}"
        assert "Traceback" not in result.stdout, f"{phase}\n{result.stdout[-3000:]}"
        assert "stopped by SIGTERM" in result.stdout, f"{phase}\n{result.stdout[-3000:]}"
    assert not (eval_dir / "metrics.json").exists()
    # The ranks agree on a stop one micro-batch after the signal (the flags travel in the background).
    assert last_step(runs["val"]) == STEPS_PER_EPOCH + 2
    for phase in ("test", "after_fit"):
        assert last_step(runs[phase]) == STEPS_PER_EPOCH and not has_test_results(runs[phase]), phase

    # The requeue of a stopped test runs just the test, on both ranks ("after_fit" left the same checkpoint; resuming
    # a pre-empted fit on 2 processes is engine/tests/test_any_device_count.py's, from the same kind of checkpoint).
    check(finished(start([sys.executable, "train.py", *train["test"], "ckpt_path=last"])))
    assert read_json(runs["test"] / "metrics.json")["test/samples"] == 360
    assert read_json(runs["test"] / "plan.json")["world_size"] == 2


def test_ctrl_c_in_training_exits_130_with_the_resume_hint(tmp_path, caplog):
    """Lightning shuts down on Ctrl-C and exits 1, silently; the run exits 130 (128 + SIGINT) naming the resume."""
    sigint = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as exited:
            in_process(
                [
                    *RUN,
                    "+callbacks.ctrl_c._target_=probes.CtrlCAtBatch",
                    "+callbacks.ctrl_c.batch_idx=2",
                    f"hydra.run.dir={tmp_path}",
                ]
            )
    finally:
        signal.signal(signal.SIGINT, sigint)  # Lightning ignores further Ctrl-C while it shuts down
    assert exited.value.code == 130
    assert f"interrupted (Ctrl-C); resume with: python train.py ckpt_path=last hydra.run.dir={tmp_path}" in caplog.text
