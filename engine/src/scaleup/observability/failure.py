"""What a rank that fails or cannot stop leaves behind: its stacks in `hang/rank<N>.txt`, the line on stderr and in the
log file, `failure.json` in the run directory; and its exit, which ends its DataLoader workers first (a blocked worker
would outlive it). The pre-emption handling (callbacks/preemption.py) and the failure watch (distributed/watchdog.py)
both report through here.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import socket
import sys
import threading
import traceback
from pathlib import Path

log = logging.getLogger("scaleup")

# How a job that did not finish exits (every rank of it), beside callbacks/preemption.py's 143 (SIGTERM) and 130
# (Ctrl-C):
EXIT_HUNG = 124  # as timeout(1): no progress within strategy.hang_timeout_minutes
EXIT_FAILED = 1  # a rank raised, or died: every rank of the job exits with it


def stacks() -> str:
    """Every thread's Python stack, most recent call last, as a traceback shows it."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    main_first = sorted(sys._current_frames().items(), key=lambda item: item[0] != threading.main_thread().ident)
    return "\n".join(
        f"Thread {names.get(ident, ident)} (most recent call last):\n{''.join(traceback.format_stack(frame))}"
        for ident, frame in main_first
    )


def dump_stacks(run_dir: Path, rank: int, where: str) -> Path:
    """Write this process's stacks, all threads, to `run_dir`/hang/rank<rank>.txt, headed by `where` it is in the
    job; returns the path."""
    path = run_dir / "hang" / f"rank{rank}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"rank {rank} (pid {os.getpid()} on {socket.gethostname()}), {where}\n\n{stacks()}")
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


def write_failure(run_dir: Path, what: str, ranks: list[int], exit_code: int, message: str) -> None:
    """Rank 0: the run directory's failure.json, beside the checkpoints that `ckpt_path=last` resumes from."""
    record = {"what": what, "ranks": ranks, "exit_code": exit_code, "message": message}
    (run_dir / "failure.json").write_text(json.dumps(record, indent=2) + "\n")


def exit_now(code: int) -> None:
    """End this process at once with `code`, what it printed and logged flushed: the main thread may be blocked in a
    collective that never returns, and an interpreter shutdown could wait on it."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    end_children()
    os._exit(code)


def own_children() -> list[multiprocessing.process.BaseProcess]:
    """This process's multiprocessing children (DataLoader workers). A process forked by other means from one that
    had children inherits its list of them (multiprocessing resets it only in the processes it starts): those are
    not this process's, and are left alone (told apart by their parent's pid, where the system shows it)."""
    return [child for child in multiprocessing.active_children() if parent_pid(child.pid) in (os.getpid(), None)]


def parent_pid(pid: int | None) -> int | None:
    """The parent process of `pid` as Linux's /proc shows it; None where it does not (another system, gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return next((int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:")), None)


def end_children() -> None:
    """Kill this process's multiprocessing children (DataLoader workers): one blocked in the user's code never looks
    for its parent, and would run on after it."""
    children = own_children()
    for child in children:
        child.kill()
    for child in children:
        child.join(1)
