"""When one rank of a multi-process job fails, hangs or is killed: the job says which, where and why within a bound,
and every rank ends.

Each rank runs a `Watchdog`, a daemon thread that reads the rank's place in the job (`Progress`, which
`scaleup.callbacks.preemption.JobControl`'s hooks write with plain attribute writes: nothing per step talks to
another process) and talks to the other ranks through the job's TCPStore at MASTER_ADDR:MASTER_PORT (the store of
init_process_group's env:// rendezvous, or torchrun's agent's), under a key prefix of its own. Never through a
collective: a hung rank never joins one.

- A hang: a rank that makes no progress for `strategy.hang_timeout_minutes` writes every thread's stack to
  `hang/rank<N>.txt` in the run directory and asks every rank to do the same; rank 0 names the rank(s) furthest
  behind (the lowest place: the ones that did not reach the point the others wait in) with the line of the user's
  code each is in, and every rank exits with EXIT_HUNG, far below the process-group timeout.
- An exception: the failing rank publishes its traceback; the other ranks print one line each and exit; rank 0
  prints the traceback last, labelled with the rank, on stderr and in the log file.
- A rank that vanished (kill -9, the OOM killer): the others' collective fails; under Lightning's launcher rank 0
  started the other processes of its node and names the one that died and its signal (torchrun's agent prints the
  same itself: "exitcode: -9 ... Signal 9 (SIGKILL) received by PID").
Rank 0 also writes `failure.json` into the run directory: what happened, to which rank(s), the exit code.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from scaleup.errors import EXIT_USER_ERROR, as_user_error, is_users_code

log = logging.getLogger("scaleup")

EXIT_HUNG = 124  # as timeout(1): no progress within strategy.hang_timeout_minutes
EXIT_FAILED = 1  # a rank raised, or died: every rank of the job exits with it
POLL_SECONDS = 5.0  # at most: how often a rank publishes its place and looks for news (sooner for short bounds)
GATHER_SECONDS = 5.0  # at least: how long the reporting rank waits for the others' answers
CONNECT_SECONDS = 5.0  # how long a failing rank tries to reach the job's store before it reports alone
# A rank's place in the job, in the order every rank passes through them (within one training micro-batch: data,
# forward, backward, optimizer step); the "end" phases: the rank did its last batch of the loop, and waits for the
# others in the loop's closing collectives (evaluation batches are uneven across ranks).
PHASES = ("start", "data", "forward", "backward", "optimizer step", "validation", "validation end", "test", "test end")


class Progress:
    """Where this rank is in the job: written by the training loop's hooks (plain attribute writes), read by the
    watchdog thread. `ticks` counts the hooks reached: while it changes, the rank makes progress."""

    def __init__(self) -> None:
        self.ticks = 0
        self.micro_batches = 0  # training micro-batches done
        self.evaluations = 0  # validation and test loops done
        self.eval_batches = 0  # batches done in the current evaluation
        self.phase = "start"

    def enter(self, phase: str) -> None:
        """This rank is now in `phase` (one of PHASES)."""
        self.phase = phase
        self.ticks += 1

    def place(self) -> dict[str, Any]:
        """The place as the other ranks read it: `order` compares across ranks (lower: not as far)."""
        order = [self.micro_batches, self.evaluations, PHASES.index(self.phase), self.eval_batches]
        return {"order": order, "phase": self.phase, "micro_batch": self.micro_batches, "batch": self.eval_batches}


def describe(place: dict[str, Any]) -> str:
    """`in forward of training micro-batch 5`, `in validation (batch 3)`, from a `Progress.place()`."""
    phase = place["phase"]
    if phase in ("validation", "test"):
        return f"in {phase} (batch {place['batch']})"
    if phase.endswith(" end"):
        return f"at the {phase} (its last batch done)"
    return f"in {phase} of training micro-batch {place['micro_batch']}" if phase != "start" else "before training"


def stacks() -> str:
    """Every thread's Python stack, most recent call last, as a traceback shows it."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    main_first = sorted(sys._current_frames().items(), key=lambda item: item[0] != threading.main_thread().ident)
    return "\n".join(
        f"Thread {names.get(ident, ident)} (most recent call last):\n{''.join(traceback.format_stack(frame))}"
        for ident, frame in main_first
    )


def users_frame() -> str | None:
    """The innermost frame of the main thread that is in the user's code: `file:line in function`, or None."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        if is_users_code(frame.f_code.co_filename):
            return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return None


def dump_stacks(run_dir: Path, rank: int, progress: Progress) -> Path:
    """Write this process's stacks, all threads, to `run_dir`/hang/rank<rank>.txt; returns the path."""
    path = run_dir / "hang" / f"rank{rank}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    head = f"rank {rank} (pid {os.getpid()} on {socket.gethostname()}), {describe(progress.place())}\n\n"
    path.write_text(head + stacks())
    return path


def to_log_file(text: str) -> None:
    """`text` into the run's log file only (rank 0's train.log; other ranks log to the null device): what is printed
    on stderr, kept in the run directory without showing twice on the terminal."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, text, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def report(text: str) -> None:
    """Print `text` on stderr and keep it in the log file."""
    print(text, file=sys.stderr, flush=True)
    to_log_file(text)


def communication_error(err: BaseException) -> bool:
    """Whether `err` says that a collective failed (a peer closed its connections), not that this rank's own code
    failed. torch raises gloo's and NCCL's failures as RuntimeError or DistBackendError with the library's message."""
    return isinstance(err, dist.DistError) or (
        isinstance(err, RuntimeError) and any(word in str(err) for word in ("gloo", "NCCL", "Connection closed"))
    )


def exit_now(code: int) -> None:
    """End this process at once with `code`, what it printed and logged flushed: the main thread may be blocked in a
    collective that never returns, and an interpreter shutdown could wait on it."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
    ) -> None:
        self.progress, self.rank, self.world_size, self.run_dir = progress, rank, world_size, run_dir
        self.hang_seconds, self.children = hang_seconds, children
        self.interval = min(POLL_SECONDS, max(0.5, hang_seconds / 10)) if hang_seconds else POLL_SECONDS
        self.gather = max(GATHER_SECONDS, 3 * self.interval)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's agent's store outlives a restart
        self.prefix = f"scaleup/watchdog/{attempt}/"
        self.address = (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
        self.host = socket.gethostname()
        self._ending = threading.Lock()  # held by the thread that ends the process: the main thread or the watchdog
        self._stopped = threading.Event()
        self._store: Any = None  # the watchdog thread's client; the main thread connects its own (`_connect`)
        self._thread = threading.Thread(target=self._run, name="scaleup-watchdog", daemon=True)

    def _connect(self, seconds: float) -> Any:
        host, port = self.address
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=seconds))
        return dist.PrefixStore(self.prefix, store)

    def start(self) -> bool:
        """Connect to the job's store and start watching; False where there is no store to meet in (no
        MASTER_ADDR/MASTER_PORT, or nothing answers there)."""
        if None in self.address:
            return False
        try:
            self._store = self._connect(self.gather + 10)
        except (RuntimeError, ValueError) as err:
            log.debug(f"no watchdog: the job's store at {':'.join(self.address)} does not answer ({err})")
            return False
        self._thread.start()
        return True

    def stop(self) -> None:
        """Stop watching (the job ended)."""
        self._stopped.set()

    # -- the watchdog thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        ticks, since, published = -1, time.monotonic(), None
        while not self._stopped.wait(self.interval):
            now = time.monotonic()
            if self.progress.ticks != ticks:
                ticks, since = self.progress.ticks, now
            stalled = self.hang_seconds is not None and now - since >= self.hang_seconds
            try:
                place = self.progress.place()
                if place != published:
                    self._store.set(f"place/{self.rank}", json.dumps(place))
                    published = place
                if self._store.check(["failure"]):
                    self._end(self._follow_failure, None, EXIT_FAILED)
                elif stalled or self._store.check(["hang/requested"]):
                    self._end(self._hang, now - since, EXIT_HUNG)
            except (RuntimeError, dist.DistError):  # the store's host (rank 0, torchrun's agent) is gone
                if stalled:
                    self._end(self._orphaned, now - since, EXIT_HUNG)

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

    def _hang(self, idle: float) -> None:
        """Dump this rank's stacks, publish where it is, and (rank 0) name the rank(s) behind; exit EXIT_HUNG."""
        dump = dump_stacks(self.run_dir, self.rank, self.progress)
        stalled = {**self.progress.place(), "frame": users_frame(), "pid": os.getpid(), "host": self.host}
        self._store.set(f"stalled/{self.rank}", json.dumps(stalled))
        self._store.set("hang/requested", str(self.rank))  # the others dump theirs now, their clocks not yet run out
        if self.rank == 0:
            self._report_hang(idle, dump.parent)
            self._store.set("hang/reported", "1")
            self.children.wait(self.gather)
        else:
            self._wait_for("hang/reported", (self.hang_seconds or 0) + 2 * self.gather)
        exit_now(EXIT_HUNG)

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

    def _report_hang(self, idle: float, dumps: Path) -> None:
        ranks = self._gathered("stalled")
        lowest = min(record["order"] for record in ranks.values())
        behind = sorted(rank for rank, record in ranks.items() if record["order"] == lowest)
        minutes = f"strategy.hang_timeout_minutes={self.hang_seconds / 60:g}" if self.hang_seconds else ""
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
        lines.append(f"every rank's Python stack (all threads): {dumps}/rank<N>.txt; every rank exits with {EXIT_HUNG}")
        log.error("\n".join(lines))
        self._write_failure("hang", behind, EXIT_HUNG, "\n".join(lines))

    @staticmethod
    def _rank_line(rank: int, record: dict[str, Any], verb: str) -> str:
        if record.get("silent"):
            return f"  rank {rank}: did not answer (last seen {describe(record)}): its process may be gone"
        where = f", at {record['frame']}" if record.get("frame") else ""
        return f"  rank {rank} (pid {record['pid']} on {record['host']}) {verb} {describe(record)}{where}"

    def _orphaned(self, idle: float) -> None:
        dump = dump_stacks(self.run_dir, self.rank, self.progress)
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
        if not self._thread.is_alive() or not isinstance(err, Exception):
            return
        self._ending.acquire()  # where the watchdog thread is ending the process already, wait for its exit here
        self._stopped.set()
        try:
            # The main thread's own client, quickly or not at all: where the store's host is the rank that is gone
            # (torchrun's agent on a lost node), the ordinary traceback ends the rank and the agent restarts it. A
            # closed port is refused at once, where the store's client would retry until its timeout.
            socket.create_connection((self.address[0], int(self.address[1])), timeout=CONNECT_SECONDS).close()
            self._store = self._connect(CONNECT_SECONDS)
            if not self._store.check(["failure"]) and communication_error(err):
                self._lost_peer(err)
            elif self._store.add("failures", 1) == 1:
                self._store.set("failure", json.dumps(self._record(err)))
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
            also = (
                f" (this rank failed too: {type(own).__name__}: {own})" if own and not communication_error(own) else ""
            )
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


def write_failure(run_dir: Path, what: str, ranks: list[int], exit_code: int, message: str) -> None:
    """Rank 0: the run directory's failure.json, beside the checkpoints that `ckpt_path=last` resumes from."""
    record = {"what": what, "ranks": ranks, "exit_code": exit_code, "message": message}
    (run_dir / "failure.json").write_text(json.dumps(record, indent=2) + "\n")
