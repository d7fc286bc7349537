"""One rank of 2 hangs, raises or is killed: the job names it (which rank, where, why) within seconds, every process
of the job is gone when it exits, and nothing is lost: `ckpt_path=last` resumes to the uninterrupted run's float64
weights.

The misbehaving rank is user_modules.MisbehavingClassifier's, chosen by the environment (MISBEHAVE=hang, raise or
wait_for_kill on rank MISBEHAVE_RANK at optimizer step MISBEHAVE_STEP); every rank writes its pid, and the rank
that misbehaves a marker file when it gets there. Hangs are watched with strategy.hang_timeout_minutes=0.1 (6 s).
"""

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from test_launchers import free_port

from conftest import (
    EXACT,
    QUICK,
    TOLERANCE,
    assert_same_weights,
    clean_env,
    in_process,
    merged,
    read_json,
    start,
    weights,
)

pytestmark = pytest.mark.slow

HANG_SECONDS = 6
EXIT_HUNG = 124
MODULE = "model._target_=user_modules.MisbehavingClassifier"
WATCHED = [MODULE, f"strategy.hang_timeout_minutes={HANG_SECONDS / 60}"]
# 8 steps of 32 samples (16 per rank), no logger, no callbacks of the config's: the smallest run that gets to step 5.
TINY = [*QUICK, "trainer.max_steps=8", "data.global_batch_size=32", "logger=none", "callbacks=[]", *WATCHED]
SLEEP_LINE = "time.sleep(10**6)  # hang, or wait_for_kill"  # MisbehavingClassifier's hang


def misbehaving(what: str, directory: Path, rank: int = 1, step: int = 5) -> dict[str, str]:
    directory.mkdir(parents=True, exist_ok=True)
    return clean_env(MISBEHAVE=what, MISBEHAVE_RANK=str(rank), MISBEHAVE_STEP=str(step), MISBEHAVE_DIR=str(directory))


def line_of(text: str) -> str:
    """`user_modules.py:<line>`: where `text` is in the test's module."""
    lines = (Path(__file__).parent / "user_modules.py").read_text().splitlines()
    return f"user_modules.py:{next(i for i, line in enumerate(lines, 1) if text in line)}"


def alive(pid: int) -> bool:
    """Whether the process `pid` runs (not a zombie: one that exited, its code not yet read by its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def pids(directory: Path) -> list[int]:
    return [int(path.read_text()) for path in sorted(directory.glob("rank*.pid"))]


class Job:
    """A job started in the background, its output in a file, with the moment its misbehaving rank got there."""

    def __init__(self, command: list[str], env: dict[str, str], marks: Path, log: Path) -> None:
        self.marks, self.log = marks, log
        self.proc = start(command, env=env, log=log)
        self.reached: float | None = None

    def wait_until_reached(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not (self.marks / "reached").exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output()[-3000:]
            time.sleep(0.05)
        self.reached = time.monotonic()

    def finish(self, timeout: float = 60) -> tuple[int, float]:
        """The exit code, and the seconds from the misbehaviour to the exit."""
        code = self.proc.wait(timeout)
        return code, time.monotonic() - self.reached

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


def train(args: list[str], env: dict[str, str], tmp_path: Path) -> Job:
    return Job([sys.executable, "train.py", *merged(args)], env, tmp_path / "marks", tmp_path / "output.txt")


def test_a_hung_rank_is_named_with_its_line_every_rank_exits_124_and_the_run_resumes(baseline, tmp_path):
    """Lightning's launcher, the float64 recipe, last.ckpt every 2 steps; rank 1 sleeps for ever in training_step
    at step 5. Within the bound: rank 0 names rank 1 and the sleep's line (output and train.log), both ranks' stacks
    are in hang/, both exit 124 and no process of the job is left; `ckpt_path=last` (step 4) on 1 process ends with
    the uninterrupted 1-process run's weights."""
    run_dir = tmp_path / "run"
    recipe = [*EXACT, "checkpoint.every_n_train_steps=2", *WATCHED, f"hydra.run.dir={run_dir}"]
    job = train([*recipe, "trainer.devices=2"], misbehaving("hang", tmp_path / "marks"), tmp_path)
    job.wait_until_reached()
    code, seconds = job.finish()
    output = job.output()
    named = named_after(tmp_path / "marks", run_dir)
    print(f"hang named {named:.1f} s after rank 1 stopped, every rank gone after {seconds:.1f} s, exit {code}")
    assert code == EXIT_HUNG, output[-3000:]
    assert named < HANG_SECONDS + 4 and seconds < HANG_SECONDS + 8, output[-3000:]
    assert not [pid for pid in pids(tmp_path / "marks") if alive(pid)]
    named = "hang: rank 1 did not reach the point the other ranks wait in"
    for text in (output, (run_dir / "train.log").read_text()):
        assert named in text and f"{line_of(SLEEP_LINE)} in training_step" in text, text[-3000:]
    assert "rank 0 (pid" in output and "waits in backward of training micro-batch 5\n" in output  # no train.py:8
    for rank in (0, 1):
        assert "Thread MainThread (most recent call last)" in (run_dir / "hang" / f"rank{rank}.txt").read_text()
    assert SLEEP_LINE in (run_dir / "hang" / "rank1.txt").read_text()
    assert read_json(run_dir / "failure.json") | {"message": ""} == {
        "what": "hang", "ranks": [1], "exit_code": EXIT_HUNG, "message": ""
    }  # fmt: skip

    assert torch_step(run_dir / "checkpoints" / "last.ckpt") == 4
    in_process([*recipe, "trainer.devices=1", "ckpt_path=last"])  # the same command, on 1 process
    worst = assert_same_weights(
        weights(baseline("one") / "checkpoints/last.ckpt"), weights(run_dir / "checkpoints/last.ckpt"), 0, TOLERANCE
    )
    print(f"resumed after the hang vs uninterrupted: largest weight difference {worst:.1e}")


def named_after(marks: Path, run_dir: Path) -> float:
    """Seconds from the misbehaviour to rank 0's report (failure.json, written just before it exits)."""
    return (run_dir / "failure.json").stat().st_mtime - (marks / "reached").stat().st_mtime


def torch_step(ckpt: Path) -> int:
    import torch

    return torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"]


def test_a_hung_rank_on_two_torchrun_nodes_is_named_and_each_agent_exits_124(tmp_path):
    """torchrun --nnodes=2, one process per node (static master address), through the engine's wrapper
    (`python -m scaleup.distributed.torchrun`): rank 1 (node 1) hangs; node 0's worker names it and its line, both
    workers exit 124 (each agent says so) within the bound, and so does each agent (torchrun's own exits 1, as on a
    crash)."""
    run_dir = tmp_path / "run"
    args = [*TINY, "trainer.devices=1", "trainer.num_nodes=2", f"hydra.run.dir={run_dir}"]
    port = free_port()
    torchrun = [sys.executable, "-m", "scaleup.distributed.torchrun", "--nnodes=2", "--nproc-per-node=1"]
    torchrun += ["--master-addr=127.0.0.1", f"--master-port={port}", "--monitor-interval=0.2"]
    env = misbehaving("hang", tmp_path / "marks")
    nodes = [
        Job(
            [*torchrun, f"--node-rank={node}", "train.py", *merged(args)], env, tmp_path / "marks", tmp_path / f"{node}"
        )
        for node in (0, 1)
    ]
    nodes[1].wait_until_reached()
    nodes[0].reached = nodes[1].reached
    ended = [node.finish() for node in nodes]
    outputs = [node.output() for node in nodes]
    named, seconds = named_after(tmp_path / "marks", run_dir), max(s for _, s in ended)
    print(
        f"2 torchrun nodes: named {named:.1f} s after the hang; agents exit {[c for c, _ in ended]} at {seconds:.1f} s"
    )
    assert [code for code, _ in ended] == [EXIT_HUNG] * 2, outputs
    assert named < HANG_SECONDS + 4 and seconds < HANG_SECONDS + 15, outputs
    assert "hang: rank 1 did not reach the point the other ranks wait in" in outputs[0], outputs[0][-3000:]
    assert f"{line_of(SLEEP_LINE)} in training_step" in outputs[0]
    for output in outputs:  # torchrun's agent: the worker's exit code; the wrapper: its own
        assert re.search(rf"exitcode\s*:\s*{EXIT_HUNG}\b", output), output[-3000:]
        assert "torchrun: a rank hung (every failed worker exited 124: the watchdog named it above): exit 124" in output
        assert "stopping at the next step" not in output  # the agent's SIGTERM to a rank the watch ends already
    assert sorted(p.name for p in (run_dir / "hang").iterdir()) == ["rank0.txt", "rank1.txt"]
    assert not [pid for pid in pids(tmp_path / "marks") if alive(pid)]


def test_an_exception_on_one_rank_is_printed_last_once_and_every_rank_stops_at_once(tmp_path):
    """Rank 1 raises in training_step: its traceback, with the raise line, labelled rank 1, is the end of stderr and
    of train.log, printed once; rank 0 says one line; the job exits 1 within seconds, leaving no process."""
    run_dir = tmp_path / "run"
    job = train(
        [*TINY, "trainer.devices=2", f"hydra.run.dir={run_dir}"], misbehaving("raise", tmp_path / "marks"), tmp_path
    )
    job.wait_until_reached()
    code, seconds = job.finish()
    output = job.output()
    print(f"exception on rank 1: every rank gone {seconds:.1f} s after it, exit {code}")
    assert code == 1 and seconds < 15, output[-3000:]
    error = "ValueError: rank 1 cannot go on at step 5"
    raised = f'File "{Path(__file__).parent / "user_modules.py"}", line {line_of("raise ValueError").split(":")[1]}'
    assert output.rstrip().endswith(error), output[-3000:]
    assert output.count(error) == 1 and output.count("Traceback") == 1, output[-6000:]
    last = output[output.index("rank 0: stopped") :]
    assert last.startswith("rank 0: stopped: rank 1 failed; its error follows\nrank 1 (pid ")
    assert raised in last and "gloo" not in last and "Connection closed" not in output
    log = (run_dir / "train.log").read_text()
    assert log.rstrip().endswith(error) and raised in log and "rank 0: stopped: rank 1 failed" in log
    assert read_json(run_dir / "failure.json")["ranks"] == [1]
    assert not [pid for pid in pids(tmp_path / "marks") if alive(pid)]


def test_a_rank_killed_by_signal_9_is_named_by_rank_0(tmp_path):
    """kill -9 of rank 1 once it reached step 5: rank 0 (Lightning's launcher started rank 1) names it and the
    signal, in one line, and exits 1 at once; no gloo traceback."""
    run_dir = tmp_path / "run"
    env = misbehaving("wait_for_kill", tmp_path / "marks")
    job = train([*TINY, "trainer.devices=2", f"hydra.run.dir={run_dir}"], env, tmp_path)
    job.wait_until_reached()
    rank1 = int((tmp_path / "marks" / "rank1.pid").read_text())
    os.kill(rank1, signal.SIGKILL)
    code, seconds = job.finish()
    output = job.output()
    print(f"kill -9 of rank 1: named, every rank gone {seconds:.1f} s after it, exit {code}")
    assert code == 1 and seconds < 10, output[-3000:]
    # the pid of the process rank 0 started: here the relay to the preloaded interpreter (engine/tests/preloaded.py)
    named = r"rank 0: stopped: rank 1 \(pid \d+\) was killed by signal 9 \(SIGKILL\)"
    assert re.search(named + r"\n$", output) and "Traceback" not in output, output[-3000:]
    assert re.search(named, (run_dir / "train.log").read_text())
    assert not [pid for pid in pids(tmp_path / "marks") if alive(pid)]


def test_a_process_stuck_after_sigterm_exits_143_after_the_grace_period(tmp_path):
    """SIGTERM to a process stuck in the user's code, which never reaches the next step to stop at: after the grace
    period (the hang bound, when shorter than 30 s) it writes its stacks and exits 143 on its own."""
    run_dir = tmp_path / "run"
    job = train([*TINY, f"hydra.run.dir={run_dir}"], misbehaving("hang", tmp_path / "marks", rank=0), tmp_path)
    job.wait_until_reached()
    os.kill(pids(tmp_path / "marks")[0], signal.SIGTERM)
    code, seconds = job.finish()
    print(f"SIGTERM to a stuck process: gone {seconds:.1f} s after it, exit {code}")
    assert code == 143 and HANG_SECONDS <= seconds < HANG_SECONDS + 5, job.output()[-3000:]
    assert f"got SIGTERM {HANG_SECONDS} s ago and reached no next step: exiting 143" in job.output()
    assert SLEEP_LINE in (run_dir / "hang" / "rank0.txt").read_text()


WORKER_SLEEP = "a loader worker's hang"


def test_a_hang_in_a_loader_worker_names_its_line_writes_its_stack_and_leaves_no_process(tmp_path):
    """Rank 1's training split blocks in `__getitem__` inside its DataLoader workers (2 workers, each after 40 samples):
    rank 0 names rank 1 and the worker's line (not the entry script's), the worker's stack is in
    hang/rank1-worker<K>.txt, every rank exits 124, and no process of the job is left: the ranks and the blocked
    workers, by pid."""
    run_dir, marks = tmp_path / "run", tmp_path / "marks"
    data = ["data._target_=user_modules.MisbehavingDigits", "data.num_workers=2"]
    job = train(
        [*TINY, *data, "trainer.devices=2", f"hydra.run.dir={run_dir}"],
        misbehaving("hang_in_data", marks, step=40),
        tmp_path,
    )
    job.wait_until_reached()
    code, seconds = job.finish()
    output = job.output()
    workers = [int(path.read_text()) for path in marks.glob("worker*.pid")]
    print(f"a loader worker's hang: every process gone {seconds:.1f} s after it, exit {code}, workers {workers}")
    assert code == EXIT_HUNG, output[-3000:]
    assert "hang: rank 1 did not reach the point the other ranks wait in" in output, output[-3000:]
    assert f"{line_of(WORKER_SLEEP)} in __getitem__ (DataLoader worker pid " in output, output[-3000:]
    assert "train.py:" not in output[output.index("hang: rank 1") :]
    dumps = sorted((run_dir / "hang").glob("rank1-worker*.txt"))
    assert dumps and any(f"line {line_of(WORKER_SLEEP).split(':')[1]} in __getitem__" in p.read_text() for p in dumps)
    time.sleep(0.5)  # a killed worker's exit is reaped by init once its parent is gone
    assert workers and not [pid for pid in workers + pids(marks) if alive(pid)]


def test_every_rank_slow_at_the_same_point_is_warned_once_and_the_job_finishes(tmp_path):
    """Every rank sleeps twice the hang bound at step 3, outside any collective: a slow job, not a hung one. Rank 0
    says so once, and the job finishes with exit 0 (the slow bound is strategy.timeout_minutes, 30)."""
    env = misbehaving("slow", tmp_path / "marks", step=3) | {"MISBEHAVE_SECONDS": str(2 * HANG_SECONDS)}
    job = train([*TINY, "trainer.devices=2", f"hydra.run.dir={tmp_path / 'run'}"], env, tmp_path)
    job.wait_until_reached()
    code, seconds = job.finish(120)
    output = job.output()
    print(f"every rank slow for {2 * HANG_SECONDS} s: exit {code} {seconds:.1f} s after the stall began")
    assert code == 0, output[-3000:]
    assert output.count("slow: no progress for") == 1 and "hang:" not in output, output[-3000:]


def test_a_rank_hung_in_on_fit_start_is_named_when_the_process_group_times_out_first(tmp_path):
    """strategy.timeout_minutes (12 s) below the hang bound (18 s): a warning at start-up. Rank 1 sleeps in
    on_fit_start while rank 0 waits in Lightning's barrier; the barrier times out first, and the hang is named as the
    watch names it: rank 1, its on_fit_start line, every rank's stack, failure.json, exit 124, no process left."""
    run_dir, marks = tmp_path / "run", tmp_path / "marks"
    bounds = ["strategy.timeout_minutes=0.2", "strategy.hang_timeout_minutes=0.3"]
    job = train(
        [*TINY, *bounds, "trainer.devices=2", f"hydra.run.dir={run_dir}"],
        misbehaving("hang_on_fit_start", marks),
        tmp_path,
    )
    job.wait_until_reached()
    code, seconds = job.finish(90)
    output = job.output()
    print(f"a hang in on_fit_start, process group timeout 12 s: exit {code}, {seconds:.1f} s after it")
    assert code == EXIT_HUNG, output[-3000:]
    assert "strategy.timeout_minutes=0.2 is below strategy.hang_timeout_minutes=0.3" in output
    assert "hang: rank 1 did not reach the point the other ranks wait in" in output, output[-3000:]
    assert "a collective timed out: strategy.timeout_minutes=0.2" in output
    assert f"{line_of('on_fit_start' + chr(39) + 's hang')} in on_fit_start" in output, output[-3000:]
    assert read_json(run_dir / "failure.json") | {"message": ""} == {
        "what": "hang", "ranks": [1], "exit_code": EXIT_HUNG, "message": ""
    }  # fmt: skip
    assert sorted(p.name for p in (run_dir / "hang").iterdir()) == ["rank0.txt", "rank1.txt"]
    assert not [pid for pid in pids(marks) if alive(pid)]


def hung_in_its_set_up(bounds: list[str], tmp_path: Path) -> Job:
    """A 2-process run with `bounds` whose rank 1 blocks in its DataModule's set-up (before the Trainer, while rank 0
    waits in the rendezvous), into tmp_path/run; returned once rank 1 is there."""
    data = "data._target_=user_modules.MisbehavingDigits"
    job = train(
        [*TINY, *bounds, data, "trainer.devices=2", f"hydra.run.dir={tmp_path / 'run'}"],
        misbehaving("hang_in_setup", tmp_path / "marks"),
        tmp_path,
    )
    job.wait_until_reached()
    return job


def test_a_rank_hung_in_its_set_up_is_named_before_the_rendezvous_times_out(tmp_path):
    """Rank 1 blocks in its DataModule's set-up (before the Trainer; rank 0 waits in the rendezvous), hang bound 3 s,
    strategy.timeout_minutes 0.3 (18 s): rank 0 says at the hang bound that the job is slow, not hung (a set-up has
    the longer bound); before the rendezvous would fail, rank 1 is named with its line and stack, failure.json names
    it, every rank exits 124 (no DistStoreError traceback) and no process of the job is left."""
    run_dir, marks = tmp_path / "run", tmp_path / "marks"
    job = hung_in_its_set_up(["strategy.timeout_minutes=0.3", "strategy.hang_timeout_minutes=0.05"], tmp_path)
    code, seconds = job.finish(90)
    output = job.output()
    print(f"a hang in rank 1's set-up, rendezvous timeout 18 s: exit {code}, {seconds:.1f} s after it")
    assert code == EXIT_HUNG, output[-3000:]
    assert "slow: no progress for" in output and "DistStoreError" not in output, output[-3000:]
    assert "Traceback" not in output and "recvValue failed" not in output, output[-3000:]
    assert "hang: rank 1 did not reach the point the other ranks wait in" in output, output[-3000:]
    assert "the rendezvous fails at strategy.timeout_minutes=0.3" in output
    assert f"{line_of('a set-up' + chr(39) + 's hang')} in build_splits" in output, output[-3000:]
    assert read_json(run_dir / "failure.json")["ranks"] == [1]
    assert "a set-up's hang" in (run_dir / "hang" / "rank1.txt").read_text()
    assert not [pid for pid in [*pids(marks), job.proc.pid] if alive(pid)]


def test_without_a_hang_bound_a_rank_left_in_its_set_up_by_a_failed_rendezvous_ends(tmp_path):
    """strategy.hang_timeout_minutes=0 (no hang bound), strategy.timeout_minutes 0.2 (12 s): rank 1 blocks in its
    DataModule's set-up while rank 0 waits in the rendezvous, which fails: one line (no traceback, which would show
    only where Lightning starts the process group; no rank joined to name), failure.json, exit 1. Rank 1's watch
    finds the job's store gone and, with no hang bound, ends it at the process group's bound: its stack written,
    exit 124, no process of the job left running."""
    run_dir, marks = tmp_path / "run", tmp_path / "marks"
    job = hung_in_its_set_up(["strategy.timeout_minutes=0.2", "strategy.hang_timeout_minutes=0"], tmp_path)
    code, _ = job.finish(90)
    deadline = time.monotonic() + 60
    while [pid for pid in pids(marks) if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.2)
    output = job.output()
    print(f"rank 0 exited {code}; rank 1 ended {time.monotonic() - job.reached:.1f} s after its hang began")
    line = (
        "error: the processes did not all meet: 1 of 2 joined rank 0 within strategy.timeout_minutes; the others are "
        "slow or hung in their set-up (the data, the model) or never started. A rank left behind ends by itself, its "
        f"stack in {run_dir / 'hang'}; with strategy.hang_timeout_minutes set, a rank hung in its set-up is named "
        "sooner, with its stack"
    )
    assert code == 1 and line in output.splitlines() and "Traceback" not in output, output[-3000:]
    assert "TCPStore" not in output  # no C++ stack of torch's for a request to the store that is gone
    failure = read_json(run_dir / "failure.json")
    assert (failure["what"], failure["ranks"], failure["exit_code"], failure["message"]) == ("rendezvous", [], 1, line)
    assert not [pid for pid in pids(marks) if alive(pid)], output[-3000:]
    assert "rank 1: no progress for" in output and "is gone (rank 0 or the launcher ended): exiting with 124" in output
    assert "a set-up's hang" in (run_dir / "hang" / "rank1.txt").read_text()


def place(micro_batch: int, phase: str, doing: str = "working", warm: bool = True) -> dict:
    from scaleup.distributed.watchdog import PHASES

    return {"order": [micro_batch, 0, PHASES.index(phase), 0], "phase": phase, "doing": doing, "warm": warm}


@pytest.mark.parametrize(
    ("places", "slow", "waited_for"),
    [
        ({0: place(3, "forward"), 1: place(3, "forward")}, True, [0, 1]),  # every rank at once, none waiting
        ({0: place(5, "backward"), 1: place(5, "forward")}, False, [1]),  # rank 1 stopped, rank 0 went on
        ({0: place(0, "start", "waiting"), 1: place(0, "start")}, False, [1]),  # a barrier waits for a hook
        ({0: place(4, "data", "own work"), 1: place(4, "data", "waiting")}, True, [0]),  # rank 0 writes a checkpoint
        ({0: place(0, "backward", warm=False), 1: place(0, "forward", warm=False)}, True, [1]),  # first step compiles
        ({0: place(0, "start", "waiting", False), 1: place(0, "set-up", warm=False)}, True, [1]),  # a long set-up
    ],
)
def test_a_stall_is_slow_where_no_rank_waits_for_a_stopped_one(places, slow, waited_for):
    """The watch's rules, on the places the ranks publish: a hang is a rank the others wait for (in a collective, or
    further on), or one that stopped while they went on; every rank at the same point, or the waited-for rank in its
    set-up, first step or checkpoint I/O, is slow."""
    from scaleup.distributed.watchdog import slow_stall
    from scaleup.distributed.watchdog import waited_for as waited

    assert (slow_stall(places), waited(places)) == (slow, waited_for)
