"""When one rank of a multi-process job fails, hangs or is killed: the job says which, where and why within a bound,
and every rank ends.

Each rank runs a `Watchdog`, a daemon thread that reads the rank's place in the job (`Progress`, which `JobWatch`'s
hooks write with plain attribute writes: nothing per step talks to another process) and talks to the other ranks
through the job's TCPStore at MASTER_ADDR:MASTER_PORT (the store of init_process_group's env:// rendezvous, or
torchrun's agent's), under a key prefix of its own. Never through a
collective: a hung rank never joins one.

- A hang: a rank that the others wait for, or one that stops while the others go on. A rank that makes no progress
  for `strategy.hang_timeout_minutes` reads every rank's place; where they say hang, it writes every thread's stack
  to `hang/rank<N>.txt` in the run directory (its DataLoader workers' to `hang/rank<N>-worker<K>.txt`) and asks
  every rank to do the same; rank 0 names the rank(s) the others wait for (the lowest place, and there the ones not
  waiting in a collective) with the line of the user's code each is in (a worker's, where the rank waits on its
  workers), and every rank exits with EXIT_HUNG, far below the process-group timeout. A collective that times out
  (strategy.timeout_minutes) is reported the same way.
- Slow, not hung: every rank at the same point with none waiting in a collective, or the rank the others wait for
  in work of its own (before its first training step ends: the set-up, a restore, a compile; checkpoint I/O). One
  warning, and the job goes on; it ends as hung only after the slow bound, max(strategy.timeout_minutes,
  strategy.hang_timeout_minutes).
- An exception: the failing rank publishes its traceback; the other ranks print one line each and exit; rank 0
  prints the traceback last, labelled with the rank, on stderr and in the log file.
- A rank that vanished (kill -9, the OOM killer): the others' collective fails; under Lightning's launcher rank 0
  started the other processes of its node and names the one that died and its signal (torchrun's agent prints the
  same itself: "exitcode: -9 ... Signal 9 (SIGKILL) received by PID").
Rank 0 also writes `failure.json` into the run directory: what happened, to which rank(s), the exit code. A rank
that exits so ends its own child processes (DataLoader workers) first: a blocked worker would outlive it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import torch.distributed as dist
from lightning.pytorch import Callback

from scaleup.errors import EXIT_USER_ERROR, as_user_error, is_users_code, record_for_launcher
from scaleup.observability.failure import (
    EXIT_FAILED,
    EXIT_HUNG,
    dump_stacks,
    exit_now,
    own_children,
    report,
    write_failure,
)

log = logging.getLogger("scaleup")

POLL_SECONDS = 5.0  # at most: how often a rank publishes its place and looks for news (sooner for short bounds)
GATHER_SECONDS = 5.0  # at least: how long the reporting rank waits for the others' answers
CONNECT_SECONDS = 5.0  # how long a failing rank tries to reach the job's store before it reports alone
# A rank's place in the job, in the order every rank passes through them: the set-up (the data, the model and the
# plan, before the Trainer: watched where the launcher re-runs the script), the start (the rendezvous, the hooks
# before the first batch), then within one training micro-batch: data, forward, backward, optimizer step; the "end"
# phases: the rank did its last batch of the loop, and waits for the others in the loop's closing collectives
# (evaluation batches are uneven across ranks).
PHASES = (
    *("set-up", "start", "data", "forward", "backward", "optimizer step"),
    *("validation", "validation end", "test", "test end"),
)
WORKER_DUMP_SECONDS = 1.0  # at most: how long a rank waits for one DataLoader worker's stack
# What a rank's main thread does, told by the innermost frame of its stack in one of these (parts of paths): work
# with a bound of its own (a compile, checkpoint I/O), or a wait in a collective (the rendezvous included).
OWN_WORK = (
    *("torch/distributed/checkpoint/", "torch/_dynamo/", "torch/_inductor/", "torch/serialization.py"),
    *("lightning/fabric/plugins/io/", "scaleup/checkpoints/"),
)
COLLECTIVE = "torch/distributed/"


class Progress:
    """Where this rank is in the job: written by the training loop's hooks (plain attribute writes), read by the
    watchdog thread. `ticks` counts the hooks reached: while it changes, the rank makes progress."""

    def __init__(self, phase: str = "start") -> None:
        self.ticks = 0
        self.micro_batches = 0  # training micro-batches done
        self.evaluations = 0  # validation and test loops done
        self.eval_batches = 0  # batches done in the current evaluation
        self.phase = phase

    def enter(self, phase: str) -> None:
        """This rank is now in `phase` (one of PHASES)."""
        self.phase = phase
        self.ticks += 1

    @property
    def warm(self) -> bool:
        """Whether this process finished a training micro-batch or an evaluation batch: until then (the set-up, a
        restore, the first step's compile) a stall is slow, not hung, up to the slow bound."""
        return self.micro_batches > 0 or self.evaluations > 0 or self.eval_batches > 0

    def place(self) -> dict[str, Any]:
        """The place as the other ranks read it: `order` compares across ranks (lower: not as far); `doing`: what the
        main thread does there (`main_thread_doing`)."""
        order = [self.micro_batches, self.evaluations, PHASES.index(self.phase), self.eval_batches]
        return {
            "order": order,
            "phase": self.phase,
            "micro_batch": self.micro_batches,
            "batch": self.eval_batches,
            "doing": main_thread_doing(),
            "warm": self.warm,
        }


def describe(place: dict[str, Any]) -> str:
    """`in forward of training micro-batch 5`, `in validation (batch 3)`, from a `Progress.place()`."""
    phase = place["phase"]
    if phase in ("validation", "test"):
        return f"in {phase} (batch {place['batch']})"
    if phase.endswith(" end"):
        return f"at the {phase} (its last batch done)"
    if phase == "set-up":
        return "in its set-up (data, model and plan, before the process group)"
    return f"in {phase} of training micro-batch {place['micro_batch']}" if phase != "start" else "before training"


def main_thread_frames() -> list[FrameType]:
    """The main thread's frames, most recent call first."""
    frame, frames = sys._current_frames().get(threading.main_thread().ident), []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


def main_thread_doing() -> str:
    """What the main thread does, by the innermost frame that tells: `waiting` in a collective (for the other ranks),
    `own work` (a compile, checkpoint I/O: a bound of its own), else `working` (the user's code, the step's compute)."""
    for frame in main_thread_frames():
        filename = frame.f_code.co_filename
        if any(part in filename for part in OWN_WORK):
            return "own work"
        if COLLECTIVE in filename:
            return "waiting"
    return "working"


def users_frame() -> str | None:
    """The innermost frame of the main thread that is in the user's code: `file:line in function`, or None. The
    entry script's module level (`train.py:8 in <module>`) is where every rank is, so it is never the answer."""
    for frame in main_thread_frames():
        code = frame.f_code
        entry = code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__"
        if is_users_code(code.co_filename) and not entry:
            return f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
    return None


FAULTHANDLER_FRAME = re.compile(r'File "(.+)", line (\d+) in (\S+)')


def users_frame_in(dump: str) -> str | None:
    """The innermost frame of the user's code in a faulthandler dump (most recent call first), as `users_frame`."""
    for filename, line, function in FAULTHANDLER_FRAME.findall(dump):
        if is_users_code(filename) and function != "<module>":
            return f"{filename}:{line} in {function}"
    return None


class WorkerStacks:
    """The stacks of this rank's DataLoader workers, which the rank cannot read itself: faulthandler, registered on
    SIGUSR2 before the loaders fork their workers, is inherited by each forked worker, which then writes its stack
    into the same (unlinked) file when signalled; workers started another way do not answer, and are skipped."""

    def __init__(self) -> None:
        self.file: Any = None

    def register(self) -> None:
        """Install the handler in this process, unless SIGUSR2 is taken already (by the user's code)."""
        if self.file is None and signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL:
            self.file = tempfile.TemporaryFile()  # noqa: SIM115 (open as long as the process: its workers write in it)
            faulthandler.register(signal.SIGUSR2, file=self.file, all_threads=True)

    def dump(self, directory: Path, rank: int) -> list[tuple[int, str | None]]:
        """Each child process's stack to `directory`/rank<rank>-worker<K>.txt; (pid, its innermost frame of the user's
        code) for each that answered."""
        answered = []
        if self.file is None:
            return answered
        for number, child in enumerate(own_children()):
            stack = self._stack_of(child.pid)
            if stack:
                (directory / f"rank{rank}-worker{number}.txt").write_text(f"pid {child.pid}\n\n{stack}")
                answered.append((child.pid, users_frame_in(stack)))
        return answered

    def _stack_of(self, pid: int) -> str:
        """Signal `pid` and read what it appended to the shared file (done when the file stops growing)."""
        fd = self.file.fileno()
        start = size = os.fstat(fd).st_size
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR2)
        deadline = time.monotonic() + WORKER_DUMP_SECONDS
        while time.monotonic() < deadline:
            time.sleep(0.05)
            grown = os.fstat(fd).st_size
            if grown == size > start:
                break
            size = grown
        return os.pread(fd, size - start, start).decode(errors="replace")


def communication_error(err: BaseException) -> bool:
    """Whether `err` says that a collective failed (a peer closed its connections), not that this rank's own code
    failed. torch raises gloo's and NCCL's failures as RuntimeError or DistBackendError with the library's message."""
    return isinstance(err, dist.DistError) or (
        isinstance(err, RuntimeError) and any(word in str(err) for word in ("gloo", "NCCL", "Connection closed"))
    )


def timed_out(err: BaseException) -> bool:
    """Whether `err` says that a collective or the rendezvous ran out of the process group's time (gloo: "Timed out
    waiting ...", the store: "... clients joined"), not that a peer went away."""
    return communication_error(err) and ("Timed out" in str(err) or "timed out" in str(err))


def waited_for(places: dict[int, dict[str, Any]]) -> list[int]:
    """The ranks the others wait for: those at the lowest place (not as far), and of them the ones not waiting in a
    collective (a rank in a barrier waits for one in the user's code at the same hook)."""
    lowest = min(record["order"] for record in places.values())
    behind = sorted(rank for rank, record in places.items() if record["order"] == lowest)
    return [rank for rank in behind if places[rank].get("doing") != "waiting"] or behind


def slow_stall(places: dict[int, dict[str, Any]]) -> bool:
    """Whether a stall is slowness, not a hang: every rank at the same point with none waiting in a collective, or
    each rank the others wait for busy with work of its own bound (before its first step ends: set-up, restore,
    compile; checkpoint I/O) or found slow already. `places`: every rank's."""
    if len({str(record["order"]) for record in places.values()}) == 1 and all(
        record.get("doing") != "waiting" for record in places.values()
    ):
        return True
    return all(
        not places[rank].get("warm") or places[rank].get("doing") == "own work" or places[rank].get("slow")
        for rank in waited_for(places)
    )


_SET_UP_WATCH: Watchdog | None = None  # this process's watch started before its set-up, until JobControl takes it


def watch_the_set_up(**settings: Any) -> None:
    """Start this rank's watch before its set-up (the data, the model, the plan), where the launcher re-runs the
    script in every rank: a rank that hangs there, while the others wait for it in the rendezvous, is named too.
    `settings`: Watchdog's, but the progress and the children."""
    global _SET_UP_WATCH
    if _SET_UP_WATCH is not None:  # a job of this process that ended before its Trainer took its watch over
        _SET_UP_WATCH.stop()
    _SET_UP_WATCH = Watchdog(Progress("set-up"), children=Children(), **settings)
    _SET_UP_WATCH.start(before_the_store=True)


def set_up_watch() -> Watchdog | None:
    """The watch `watch_the_set_up` started in this process, once: JobControl takes it over."""
    global _SET_UP_WATCH
    watch, _SET_UP_WATCH = _SET_UP_WATCH, None
    return watch


def in_one_line(err: BaseException, failing: dict[str, Any]) -> str:
    """This rank's own failure beside the failing rank's `failing` record, in one line (its error follows in full):
    the same mistake, a mistake's message, or the exception's type and first line (torch's run to several)."""
    mistake = as_user_error(err)
    if mistake is not None:
        return "the same error" if failing["text"].endswith(f"error: {mistake}") else f"error: {mistake}"
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"


@dataclass
class Children:
    """The processes Lightning's launcher started on this node (rank 0 of the node is their parent), by global rank."""

    procs: dict[int, subprocess.Popen] = field(default_factory=dict)

    def dead(self) -> dict[int, str]:
        """Rank -> `rank 1 (pid N) was killed by signal 9 (SIGKILL)` (or `exited with code C`) for each that ended."""
        ended = {}
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None and code < 0:
                ended[rank] = (
                    f"rank {rank} (pid {proc.pid}) was killed by signal {-code} ({signal.Signals(-code).name})"
                )
            elif code:
                ended[rank] = f"rank {rank} (pid {proc.pid}) exited with code {code}"
        return ended

    def wait(self, seconds: float) -> None:
        """Wait for them to exit (no process of the job outlives it), killing any still there after `seconds`."""
        deadline = time.monotonic() + seconds
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Watchdog:
    """The thread that notices a hang, a failure or a lost rank, and ends this rank (see the module's docstring)."""

    def __init__(
        self,
        progress: Progress,
        *,
        rank: int,
        world_size: int,
        run_dir: Path,
        hang_seconds: float | None,
        children: Children,
        collective_seconds: float | None = None,
    ) -> None:
        """`collective_seconds`: the process group's timeout (strategy.timeout_minutes); with `hang_seconds` it sets
        the slow bound, up to which a slow stall goes on."""
        self.progress, self.rank, self.world_size, self.run_dir = progress, rank, world_size, run_dir
        self.hang_seconds, self.children, self.collective_seconds = hang_seconds, children, collective_seconds
        self.slow_seconds = max(hang_seconds or 0, collective_seconds or 0) or None
        self.workers = WorkerStacks()
        self._since = time.monotonic()  # when this rank last made progress
        self._slow = False  # this stall was found slow, not hung: it may last up to the slow bound
        self._warned = False  # the slow warning is said once a job
        self._unanswered = 0  # the store's port refused this many times in a row
        self.interval = min(POLL_SECONDS, max(0.5, hang_seconds / 10)) if hang_seconds else POLL_SECONDS
        self.gather = max(GATHER_SECONDS, 3 * self.interval)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's agent's store outlives a restart
        self.prefix = f"scaleup/watchdog/{attempt}/"
        self.address = ("", "")  # the job's store, read from the environment when it is reached (`_reach`)
        self.host = socket.gethostname()
        self._ending = threading.Lock()  # held by the thread that ends the process: the main thread or the watchdog
        self._stopped = threading.Event()
        self._store: Any = None  # the watchdog thread's client; the main thread connects its own (`_connect`)
        self._thread = threading.Thread(target=self._run, name="scaleup-watchdog", daemon=True)

    def _connect(self, seconds: float) -> Any:
        host, port = self.address
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=seconds))
        return dist.PrefixStore(self.prefix, store)

    def _reach(self) -> bool:
        """Connect to the job's store at MASTER_ADDR:MASTER_PORT; False where there is none (yet), or nothing answers
        there (a port that refuses is tried first: the store's client would retry, and log, until its timeout)."""
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if host is None or port is None:
            return False
        self.address = (host, port)
        if not self._answers():
            return False
        try:
            self._store = self._connect(self.gather + 10)
        except (RuntimeError, ValueError) as err:
            log.debug(f"the watch: the job's store at {host}:{port} does not answer ({err})")
            return False
        return True

    def start(self, before_the_store: bool = False) -> bool:
        """Connect to the job's store and start watching; False where there is no store to meet in (no
        MASTER_ADDR/MASTER_PORT, or nothing answers there). `before_the_store`: start now, and meet the others in
        the store once it answers (rank 0 starts it in the rendezvous, after the set-up)."""
        if not before_the_store and not self._reach():
            return False
        self._thread.start()
        return True

    def take_over(self, children: Children) -> bool:
        """The Trainer's set-up (JobControl) takes over a watch started before the set-up, with the processes the
        launcher started, now known; False where the job's store (which the process group has now) does not answer."""
        self.children = children
        return self._store is not None or self._reach()

    def stop(self) -> None:
        """Stop watching (the job ended)."""
        self._stopped.set()

    @property
    def ending(self) -> bool:
        """Whether this rank is being ended by the watch (a hang, a failure): a SIGTERM then changes nothing."""
        return self._ending.locked()

    # -- the watchdog thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        ticks, published = -1, None
        while not self._stopped.wait(self.interval):
            if self._store is None and not self._reach():
                continue
            now = time.monotonic()
            if self.progress.ticks != ticks:
                ticks, self._since, self._slow = self.progress.ticks, now, False
            idle = now - self._since
            stalled = self.hang_seconds is not None and idle >= self.hang_seconds
            # A rank without progress knocks on the store's port first: torch logs its C++ stack (TCPStore's "sendBytes
            # failed") for every request sent to a store that is gone (its host, rank 0 or torchrun's agent, ended).
            if idle > self.interval and not self._answers():
                self._unanswered += 1
                if self._unanswered > 1:  # twice in a row: not a connection the store was too busy to take
                    self._store_gone(idle)
                continue
            self._unanswered = 0
            try:
                place = {**self.progress.place(), "slow": self._slow}
                if place != published:
                    self._store.set(f"place/{self.rank}", json.dumps(place))
                    published = place
                if self._store.check(["failure"]):
                    self._end(self._follow_failure, None, EXIT_FAILED)
                elif self._store.check(["hang/requested"]) or (stalled and self._hung(idle)):
                    self._end(self._hang, idle, EXIT_HUNG)
            except (RuntimeError, dist.DistError):  # the store's host (rank 0, torchrun's agent) is gone
                self._store_gone(idle)

    def _answers(self) -> bool:
        """Whether the job's store takes a connection: a port nobody listens on refuses it at once, where the store's
        client would retry (and log) until its timeout."""
        try:
            socket.create_connection((self.address[0], int(self.address[1])), timeout=CONNECT_SECONDS).close()
        except (OSError, ValueError):
            return False
        return True

    def _store_gone(self, idle: float) -> None:
        """The job's store is gone: this rank ends once idle past the hang bound, or without one, the process group's
        (a rank left in its set-up by a failed rendezvous ends)."""
        if idle >= (self.hang_seconds or self.collective_seconds or float("inf")):
            self._end(self._orphaned, idle, EXIT_HUNG)

    def _hung(self, idle: float) -> bool:
        """This rank made no progress within the hang bound: whether that is a hang (see `slow_stall`), or slowness
        that may go on up to the slow bound (rank 0 says so once)."""
        if not self._slow:
            places = self._places()
            if len(places) < self.world_size:  # a rank not in the store yet (in its set-up): nothing to compare
                return idle >= self._slow_bound()
            if not slow_stall(places):
                return True
            self._slow = True
            self._store.set(f"place/{self.rank}", json.dumps({**self.progress.place(), "slow": True}))
            self._warn_slow(idle)
        return idle >= self._slow_bound()

    def _slow_bound(self) -> float:
        """How long a slow stall may last. A rank in the rendezvous (done with its set-up, no process group yet)
        waits there until strategy.timeout_minutes, when the rendezvous fails and takes rank 0's store (where the
        ranks meet) with it: the watch ends such a stall while the store is there."""
        bound = self.slow_seconds or 0
        if self.collective_seconds and self.progress.phase == "start" and not dist.is_initialized():
            return max(self.hang_seconds or 0, min(bound, self.collective_seconds - self.gather - 2 * self.interval))
        return bound

    def _warn_slow(self, idle: float) -> None:
        """Rank 0, once a job: the stall is slow, not hung, and when it would end as hung (unless it does now)."""
        if self.rank == 0 and not self._warned and idle < self._slow_bound():
            self._warned = True
            report(
                f"slow: no progress for {idle:.0f} s (strategy.hang_timeout_minutes={self.hang_seconds / 60:g}), but "
                "no rank waits for another stopped one (every rank is at the same point, or the one they wait for is "
                "in its set-up, first step, compile or checkpoint I/O): the job goes on, and ends as hung only after "
                f"{self.slow_seconds:.0f} s without progress (strategy.timeout_minutes, or the hang bound if longer)"
            )

    def _places(self) -> dict[int, dict[str, Any]]:
        """The places the ranks last published, by rank (a rank that published none is left out)."""
        keys = [f"place/{rank}" for rank in range(self.world_size)]
        return {rank: json.loads(self._store.get(key)) for rank, key in enumerate(keys) if self._store.check([key])}

    def _end(self, how: Callable[[Any], None], argument: Any, code: int) -> None:
        """Run `how(argument)`, which ends the process, unless the main thread is ending it already; exit `code` when
        the store goes away meanwhile."""
        if self._stopped.is_set() or not self._ending.acquire(blocking=False):
            return
        try:
            how(argument)
        except (RuntimeError, dist.DistError) as err:
            report(f"rank {self.rank}: lost the job's store at {':'.join(self.address)} while stopping ({err})")
            exit_now(code)

    def _hang(self, idle: float, timed_out: bool = False) -> None:
        """Dump this rank's stacks (and its DataLoader workers'), publish where it is, and (rank 0) name the rank(s)
        the others wait for; exit EXIT_HUNG. `timed_out`: this rank's collective timed out (it was waiting)."""
        dump = dump_stacks(self.run_dir, self.rank, describe(self.progress.place()))
        workers = self.workers.dump(dump.parent, self.rank)
        # A rank whose main thread waits on its workers: the line a worker is blocked in.
        frame = users_frame() or next((f"{at} (DataLoader worker pid {pid})" for pid, at in workers if at), None)
        stalled = {**self.progress.place(), "frame": frame, "pid": os.getpid(), "host": self.host}
        if timed_out:
            stalled["doing"] = "waiting"
        self._store.set(f"stalled/{self.rank}", json.dumps(stalled))
        self._store.set("hang/requested", str(self.rank))  # the others dump theirs now, their clocks not yet run out
        if self.rank == 0:
            self._report_hang(idle, dump.parent, timed_out or self._store.check(["hang/timed_out"]))
            self._store.set("hang/reported", "1")
            # The store goes with rank 0: the others read the news first (their launcher's children or not).
            self._wait_for_all("hang/left", 2 * self.interval + 1)
            self.children.wait(self.gather)
        elif self._wait_for("hang/reported", (self.hang_seconds or 0) + 2 * self.gather):
            self._store.set(f"hang/left/{self.rank}", "1")
        exit_now(EXIT_HUNG)

    def _wait_for_all(self, prefix: str, seconds: float) -> None:
        """Wait up to `seconds` for every other rank's `<prefix>/<rank>` key."""
        keys = [f"{prefix}/{rank}" for rank in range(self.world_size) if rank != self.rank]
        deadline = time.monotonic() + seconds
        with contextlib.suppress(RuntimeError, dist.DistError):
            while time.monotonic() < deadline and not all(self._store.check([key]) for key in keys):
                time.sleep(0.05)

    def _gathered(self, prefix: str) -> dict[int, dict[str, Any]]:
        """Every rank's `<prefix>/<rank>` record, waiting up to `gather` seconds for the missing ones; a rank that
        did not answer has its last published place instead, marked `"silent": True`."""
        deadline = time.monotonic() + self.gather
        found: dict[int, dict[str, Any]] = {}
        while True:
            for rank in range(self.world_size):
                if rank not in found and self._store.check([f"{prefix}/{rank}"]):
                    found[rank] = json.loads(self._store.get(f"{prefix}/{rank}"))
            if len(found) == self.world_size or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for rank in set(range(self.world_size)) - found.keys():
            last = json.loads(self._store.get(f"place/{rank}")) if self._store.check([f"place/{rank}"]) else None
            found[rank] = {**(last or {"order": [-1], "phase": "start", "micro_batch": 0, "batch": 0}), "silent": True}
        return found

    def _report_hang(self, idle: float, dumps: Path, timed_out: bool) -> None:
        ranks = self._gathered("stalled")
        behind = waited_for(ranks)
        minutes = f"strategy.hang_timeout_minutes={self.hang_seconds / 60:g}" if self.hang_seconds else ""
        if timed_out:
            minutes = f"a collective timed out: strategy.timeout_minutes={(self.collective_seconds or 0) / 60:g}"
        elif not dist.is_initialized() and self.collective_seconds:
            minutes = f"the rendezvous fails at strategy.timeout_minutes={self.collective_seconds / 60:g}"
        if len(behind) == self.world_size:
            head = f"hang: no rank made progress for {idle:.0f} s ({minutes}); every rank is at the same point:"
        else:
            names = ", ".join(map(str, behind))
            head = (
                f"hang: rank{'s' * (len(behind) > 1)} {names} did not reach the point the other ranks wait in; "
                f"no progress for {idle:.0f} s ({minutes}):"
            )
        waiting = [rank for rank in sorted(ranks) if rank not in behind]
        lines = [head, *(self._rank_line(rank, ranks[rank], "is") for rank in behind)]
        lines += [self._rank_line(rank, ranks[rank], "waits") for rank in waiting[:3]]
        lines += [f"  ... and {len(waiting) - 3} more ranks waiting"] if len(waiting) > 3 else []
        workers = " (DataLoader workers: rank<N>-worker<K>.txt)" if any(dumps.glob("rank*-worker*.txt")) else ""
        lines.append(
            f"every rank's Python stack (all threads): {dumps}/rank<N>.txt{workers}; every rank exits with {EXIT_HUNG}"
        )
        log.error("\n".join(lines))
        self._write_failure("hang", behind, EXIT_HUNG, "\n".join(lines))

    @staticmethod
    def _rank_line(rank: int, record: dict[str, Any], verb: str) -> str:
        if record.get("silent"):
            return f"  rank {rank}: did not answer (last seen {describe(record)}): its process may be gone"
        where = f", at {record['frame']}" if record.get("frame") else ""
        return f"  rank {rank} (pid {record['pid']} on {record['host']}) {verb} {describe(record)}{where}"

    def _orphaned(self, idle: float) -> None:
        dump = dump_stacks(self.run_dir, self.rank, describe(self.progress.place()))
        report(
            f"rank {self.rank}: no progress for {idle:.0f} s and the job's store at {':'.join(self.address)} is gone "
            f"(rank 0 or the launcher ended): exiting with {EXIT_HUNG}; this rank's stack: {dump}"
        )
        exit_now(EXIT_HUNG)

    def _wait_for(self, key: str, seconds: float) -> bool:
        """Whether `key` appeared in the store within `seconds` (False also when the store is gone)."""
        deadline = time.monotonic() + seconds
        with contextlib.suppress(RuntimeError, dist.DistError):
            while time.monotonic() < deadline:
                if self._store.check([key]):
                    return True
                time.sleep(0.1)
        return False

    # -- failures ---------------------------------------------------------------------------------------------

    def failed(self, err: BaseException) -> None:
        """The main thread caught `err` in a stage (the Trainer's on_exception). Returns only when there is nothing
        for the watchdog to do; otherwise reports what happened, in its turn, and ends the process."""
        if not self._thread.is_alive() or self._store is None or not isinstance(err, Exception):
            return
        self._ending.acquire()  # where the watchdog thread is ending the process already, wait for its exit here
        self._stopped.set()
        try:
            # The main thread's own client, quickly or not at all: where the store's host is the rank that is gone
            # (torchrun's agent on a lost node), the ordinary traceback ends the rank and the agent restarts it.
            if not self._answers():
                raise ConnectionRefusedError("nothing listens there")
            self._store = self._connect(CONNECT_SECONDS)
            if not self._store.check(["failure"]) and timed_out(err):
                # The process group's own bound ran out first: the rank it waited for is named as in a hang.
                self._store.set("hang/timed_out", str(self.rank))
                self._hang(time.monotonic() - self._since, timed_out=True)
            if not self._store.check(["failure"]) and communication_error(err):
                self._lost_peer(err)
            elif self._store.add("failures", 1) == 1:
                record = self._record(err)
                self._store.set("failure", json.dumps(record))
                record_for_launcher(record["text"])  # torchrun's summary: this rank is the root cause
                self._follow_failure(None, own=err, first=True)
            self._follow_failure(None, own=err)
        except (OSError, RuntimeError, dist.DistError):  # the store is gone: the ordinary traceback
            self._ending.release()

    def _record(self, err: BaseException) -> dict[str, Any]:
        """What the other ranks read of this rank's failure: a bug's traceback, or a user mistake's one line."""
        mistake = as_user_error(err)
        if mistake is not None:
            return {"rank": self.rank, "text": f"rank {self.rank}: error: {mistake}", "exit_code": EXIT_USER_ERROR}
        text = "".join(traceback.format_exception(err)).rstrip()
        head = f"rank {self.rank} (pid {os.getpid()} on {self.host}) failed {describe(self.progress.place())}:"
        return {"rank": self.rank, "text": f"{head}\n{text}", "exit_code": EXIT_FAILED}

    def _follow_failure(self, _: Any, own: BaseException | None = None, first: bool = False) -> None:
        """Another rank's failure is in the store (or this rank's, `first`): one line, and rank 0 prints the failing
        rank's record last; every rank then exits EXIT_FAILED."""
        record = json.loads(self._store.get("failure"))
        failing = record["rank"]
        if not first:
            also = ""
            if own and not communication_error(own):
                also = f" (this rank failed too: {in_one_line(own, record)})"
            where = "its error follows" if self.rank == 0 else "rank 0 prints its error"
            report(f"rank {self.rank}: stopped: rank {failing} failed{also}; {where}")
        self._store.set(f"stopped/{self.rank}", "1")
        if self.rank == 0:
            self._gathered("stopped")  # the others' lines before the error, which comes last
            report(record["text"])
            self._write_failure("error", [failing], record["exit_code"], record["text"])
            self._store.set("printed", "1")
            self.children.wait(self.gather)
        elif not self._wait_for("printed", self.gather + 2 * self.interval + 5) and first:
            report(record["text"])  # rank 0 did not print it
        exit_now(record["exit_code"])

    def _lost_peer(self, err: BaseException) -> None:
        """A collective failed and no rank reported an error: a rank ended without a word (kill -9, out of memory)."""
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        deadline = time.monotonic() + 2  # a failing rank's record may be on its way
        while time.monotonic() < deadline and not (dead := self.children.dead()):
            if self._store.check(["failure"]):
                return
            time.sleep(0.05)
        if dead:
            text = f"rank {self.rank}: stopped: {'; '.join(dead.values())}"
        else:
            text = (
                f"rank {self.rank}: stopped: a collective failed ({first_line}) and no rank reported an error: one "
                "ended without a word (killed? out of memory?); the launcher's message names it"
            )
        report(text)
        if self.rank == 0:
            self._write_failure("lost rank", sorted(dead), EXIT_FAILED, text)
        self.children.wait(self.gather)
        exit_now(EXIT_FAILED)

    def _write_failure(self, what: str, ranks: list[int], exit_code: int, message: str) -> None:
        write_failure(self.run_dir, what, ranks, exit_code, message)


class JobWatch(Callback):
    """The watch as a part of the Trainer, on several processes: this rank's place in the job (`progress`), written by
    the loop's hooks below with plain attribute writes (nothing that talks to another process), and the `Watchdog`
    that reads it, started in `setup` (or the set-up's watch, taken over). `on_exception` hands the watchdog this
    rank's error, so that the failing rank is named and its traceback printed once (rank 0, last), and every rank
    ends.

    trainer.py adds it on several processes, found through the engine's registry (the `scaleup.job_watch` entry point
    `default`), before JobControl: its hooks see the batch before JobControl may stop after it.
    `hang_timeout_minutes`: strategy.hang_timeout_minutes (0 or None: no hang watch; failures are still named);
    `timeout_minutes`: strategy.timeout_minutes, the process group's, which bounds a slow stall.
    """

    def __init__(self, hang_timeout_minutes: float | None = None, timeout_minutes: float | None = None) -> None:
        self.hang_seconds = 60 * hang_timeout_minutes if hang_timeout_minutes else None
        self.collective_seconds = 60 * timeout_minutes if timeout_minutes else None
        # A watch started before the set-up (distributed/launch.py) goes on here: the set-up is done.
        self.watchdog: Watchdog | None = set_up_watch()
        self.progress = self.watchdog.progress if self.watchdog is not None else Progress()
        self.progress.enter("start")
        self._started = False  # once per job: `setup` runs for each stage

    watch_the_set_up = staticmethod(watch_the_set_up)  # what distributed/launch.py starts before the set-up

    @property
    def ending(self) -> bool:
        """Whether the watch is ending this rank (a hang, a failure): a SIGTERM then changes nothing (JobControl)."""
        return self.watchdog is not None and self.watchdog.ending

    def job_ended(self) -> None:
        """The job ended (trainer.py's TrainerJob.running): stop watching."""
        if self.watchdog is not None:
            self.watchdog.stop()

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Lightning starts the process group just before `setup`, which every rank runs together.
        self.progress.enter("start")  # past the rendezvous: progress
        if not self._started and trainer.world_size > 1 and dist.is_initialized():
            self._start(trainer)
        self._started = True

    def _start(self, trainer: L.Trainer) -> None:
        # Lightning's launcher: the processes rank 0 of this node started (local ranks 1, 2, ...), named if one dies.
        procs = getattr(trainer.strategy.launcher, "procs", None) or []
        first = trainer.global_rank - trainer.local_rank + 1
        children = Children({first + i: proc for i, proc in enumerate(procs) if isinstance(proc, subprocess.Popen)})
        if (
            self.watchdog is not None
            and self.watchdog.rank == trainer.global_rank
            and self.watchdog.take_over(children)
        ):
            self.watchdog.workers.register()
            return
        if self.watchdog is not None:  # ranks read wrong, or no store: a watch of its own, as without a set-up's watch
            self.watchdog.stop()
        watchdog = Watchdog(
            self.progress,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            run_dir=Path(trainer.default_root_dir),
            hang_seconds=self.hang_seconds,
            children=children,
            collective_seconds=self.collective_seconds,
        )
        self.watchdog = watchdog if watchdog.start() else None
        if self.watchdog is not None:
            self.watchdog.workers.register()  # before the loaders fork their workers, which inherit it

    # The loop's hooks: this rank's place for the watchdog, in plain attribute writes.
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.progress.enter("data")

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.progress.enter("data")

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self.progress.enter("forward")

    def on_before_backward(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self.progress.enter("backward")

    def on_before_optimizer_step(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self.progress.enter("optimizer step")

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self.progress.micro_batches += 1
        self.progress.enter("data")

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.progress.enter("data")

    def on_save_checkpoint(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self.progress.enter(self.progress.phase)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.progress.eval_batches = 0
        self.progress.enter("validation")

    def on_validation_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        loop = trainer.validate_loop if trainer.state.fn == "validate" else trainer.fit_loop.epoch_loop.val_loop
        self._evaluated("validation", loop.batch_progress.is_last_batch)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.progress.evaluations += 1
        self.progress.enter("data")

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.progress.eval_batches = 0
        self.progress.enter("test")

    def on_test_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self._evaluated("test", trainer.test_loop.batch_progress.is_last_batch)

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.progress.evaluations += 1
        self.progress.enter("test end")

    def _evaluated(self, phase: str, last_batch: bool) -> None:
        self.progress.eval_batches += 1
        self.progress.enter(f"{phase} end" if last_batch else phase)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self.watchdog is not None:  # an error of this rank, or a collective a peer left: named, and every rank ends
            self.watchdog.failed(exception)
