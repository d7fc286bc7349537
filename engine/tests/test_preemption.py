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

import probes
from conftest import QUICK, check, in_process, read_json, run, start
from scaleup.errors import UserError

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
    143 and no traceback; the requeued test completes. Alongside, a loss that turns NaN on rank 1 alone (from step
    5) stops both ranks at the next checkpoint (step 6) with exit 2 and the line naming step 5, said once."""
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
    nan_on_rank_1 = [*NAN_FROM_STEP_5, "+callbacks.nan.rank=1", "checkpoint.every_n_train_steps=3"]
    nan_run = [*RUN, *two, "trainer.max_epochs=1", *nan_on_rank_1, f"hydra.run.dir={tmp_path / 'nan'}"]
    nan = finished(start([sys.executable, "train.py", *nan_run]))
    results = {phase: finished(proc) for phase, proc in procs.items()}
    assert nan.returncode == 2 and nan.stdout.count(NAN_LOSS_AT_STEP_5) == 1, nan.stdout[-3000:]  # said by rank 0
    assert last_step(tmp_path / "nan") == 3
    for phase, result in results.items():
        assert result.returncode == 143, f"{phase}: exit {result.returncode}\n{result.stdout[-3000:]}"
        assert "Traceback" not in result.stdout, f"{phase}\n{result.stdout[-3000:]}"
        assert result.stdout.count("stopped by SIGTERM; ") == 1, f"{phase}\n{result.stdout[-3000:]}"
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


def ctrl_c(args: list[str], presses: int = 1) -> int:
    """Run `args` in this process with Ctrl-C after training batch 2 (`presses` times); returns the exit code."""
    sigint = signal.getsignal(signal.SIGINT)
    press = ["+callbacks.ctrl_c._target_=probes.CtrlCAtBatch", "+callbacks.ctrl_c.batch_idx=2"]
    with pytest.raises(SystemExit) as exited:
        in_process([*args, *press, f"+callbacks.ctrl_c.presses={presses}"])
    assert signal.getsignal(signal.SIGINT) == sigint  # the job put back the handler it found
    return exited.value.code


def test_ctrl_c_in_training_saves_the_step_exits_130_and_resumes_there(tmp_path, caplog):
    """Ctrl-C stops as SIGTERM does, after the step it came in (batch 2: step 3), saving last.ckpt there; exit 130
    (128 + SIGINT) naming the resume, said once; `ckpt_path=last` trains on from step 3. (Lightning alone shuts down
    on Ctrl-C, saves nothing and exits 1.)"""
    args = [*RUN, "trainer.max_epochs=1", f"hydra.run.dir={tmp_path}"]
    assert ctrl_c(args) == 130
    assert last_step(tmp_path) == 3
    hint = f"interrupted (Ctrl-C); resume with: python train.py ckpt_path=last hydra.run.dir={tmp_path}"
    assert caplog.text.count(hint) == 1
    assert f"interrupted (Ctrl-C) at step 3; saved {tmp_path}/checkpoints/last.ckpt" in caplog.text
    probe = ["+callbacks.probe._target_=probes.RankProbe", f"+callbacks.probe.out_dir={tmp_path}/probe"]
    in_process([*args, *probe, "+callbacks.probe.draw_steps=19", "ckpt_path=last"])
    steps = [batch["step"] for batch in read_json(tmp_path / "probe" / "rank0.json")["micro_batches"]]
    assert steps == list(range(3, 19)) and last_step(tmp_path) == 19


def test_ctrl_c_twice_stops_at_once_without_saving(tmp_path, caplog):
    """A second Ctrl-C does not wait for the step's end: Python's KeyboardInterrupt, nothing saved, exit 130."""
    args = [*RUN, "trainer.max_epochs=1", f"hydra.run.dir={tmp_path}"]
    assert ctrl_c(args, presses=2) == 130
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()
    assert f"interrupted (Ctrl-C); resume with: python train.py ckpt_path=last hydra.run.dir={tmp_path}" in caplog.text


NAN_FROM_STEP_5 = ["+callbacks.nan._target_=probes.NanWeightsAtStep", "+callbacks.nan.step=5"]
NAN_LOSS_AT_STEP_5 = (
    "the training loss is NaN or inf at step 5: the run stops, with no checkpoint written after that step "
    "(ckpt_path=last resumes from the one before); lower model.optimizer.lr, set trainer.gradient_clip_val, or look "
    "at that step's data; stop_on_nonfinite_loss=false trains on regardless"
)


@pytest.mark.parametrize(
    ("saves", "stopped_at", "last"),
    [(["checkpoint.every_n_train_steps=3"], 6, 3), ([], 8, None)],
    ids=["at the next save", "at the next logging step"],
)
def test_a_nan_loss_stops_the_run_naming_its_step_before_another_checkpoint(saves, stopped_at, last, tmp_path):
    """Weights NaN from step 5 (the loss from then on): the run stops with one line naming step 5 where it first
    reads the device, at the next checkpoint (step 6 of a save every 3: nothing written, last.ckpt stays at step 3)
    or logging step (8, logging every 4), not at every step; `stop_on_nonfinite_loss=false` trains on as Lightning
    does, to NaN weights in last.ckpt."""
    args = [*RUN, "trainer.max_epochs=1", "trainer.log_every_n_steps=4", *NAN_FROM_STEP_5, f"hydra.run.dir={tmp_path}"]
    with pytest.raises(UserError) as stopped:
        in_process([*args, *saves])
    assert str(stopped.value) == NAN_LOSS_AT_STEP_5
    assert probes.NanWeightsAtStep.stopped_at == stopped_at
    failure = {"what": "error", "ranks": [0], "exit_code": 2, "message": f"error: {NAN_LOSS_AT_STEP_5}"}
    assert read_json(tmp_path / "failure.json") == failure
    assert failure["message"] in (tmp_path / "train.log").read_text()
    if last is None:
        assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())
    else:
        assert last_step(tmp_path) == last
        state = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
        assert all(tensor.isfinite().all() for tensor in state["state_dict"].values())


def test_with_stop_on_nonfinite_loss_false_a_nan_loss_trains_on(tmp_path):
    args = [*RUN, "trainer.max_epochs=1", *NAN_FROM_STEP_5, "stop_on_nonfinite_loss=false", f"hydra.run.dir={tmp_path}"]
    in_process(args)
    assert last_step(tmp_path) == STEPS_PER_EPOCH
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert not all(tensor.isfinite().all() for tensor in state["state_dict"].values())


def test_a_nan_loss_at_the_entry_point_exits_2_and_keeps_the_run_directory(tmp_path):
    """`python train.py`: the line on stderr, exit 2, and the run directory stays with its train.log and failure.json
    (a refusal before the start removes the directory it made; this run had started)."""
    run_dir = tmp_path / "run"  # made by the run
    args = [*RUN, "trainer.max_epochs=1", "trainer.log_every_n_steps=4", *NAN_FROM_STEP_5, f"hydra.run.dir={run_dir}"]
    result = run(args)
    assert (result.returncode, result.stderr.splitlines()[-1]) == (2, f"error: {NAN_LOSS_AT_STEP_5}")
    assert read_json(run_dir / "failure.json")["exit_code"] == 2
    assert NAN_LOSS_AT_STEP_5 in (run_dir / "train.log").read_text()
