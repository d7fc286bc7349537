"""`python -m scaleup.distributed.torchrun [torchrun's options] train.py ...`: torchrun, exiting 143 on a pre-emption.

torch 2.14. Reason: torchrun's agent exits 1 when its job is pre-empted. Given SIGTERM, it passes the signal on to
its workers (which stop together, write last.ckpt and exit 143: callbacks/preemption.py), waits for them
(`--shutdown-timeout`, 30 s by default) and raises SignalException; the agent of another node, whose workers
stopped with 143 because a peer's were signalled, raises ChildFailedError. Both end in exit 1, which Kubernetes'
`restartPolicy: ExitCode` (143 restarts the pod, 1-127 fail the job) reads as a failed job. This runs torchrun's
own `main` in this process (the same agent, the same options) and exits 143 in those two cases instead; any other
failure keeps torchrun's exit code.
"""

from __future__ import annotations

import signal
import sys

from torch.distributed import run
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from scaleup.callbacks.preemption import EXIT_PREEMPTED


def preemption(error: SignalException | ChildFailedError) -> str | None:
    """How torchrun's run was pre-empted, or None where it was not: its agent got SIGTERM, or every failed worker
    stopped on it (exit 143 from preemption.py, or killed by the signal before its handler was installed)."""
    if isinstance(error, SignalException):
        return "the agent got SIGTERM" if error.sigval == signal.SIGTERM else None
    if all(failure.exitcode in (EXIT_PREEMPTED, -signal.SIGTERM) for failure in error.failures.values()):
        return "its workers stopped on SIGTERM"
    return None


def main(argv: list[str] | None = None) -> None:
    """Run torchrun with `argv` (default: this command's arguments); exit 143 where it ended in a pre-emption."""
    try:
        run.main(argv)
    except (SignalException, ChildFailedError) as error:
        how = preemption(error)
        if how is None:
            raise
        print(f"torchrun: pre-empted ({how}): exit {EXIT_PREEMPTED}; resume with ckpt_path=last", file=sys.stderr)
        sys.exit(EXIT_PREEMPTED)


if __name__ == "__main__":
    main()
