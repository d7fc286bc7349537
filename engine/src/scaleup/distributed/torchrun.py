"""`python -m scaleup.distributed.torchrun [torchrun's options] train.py ...`: torchrun, exiting with its workers' code
where they agree on one that tells what happened: 143 on a pre-emption, 124 on a hang.

torch 2.14. Reason: torchrun's agent exits 1 whatever its workers' exit codes. Given SIGTERM, it passes the signal on
to its workers (which stop together, write last.ckpt and exit 143: callbacks/preemption.py), waits for them
(`--shutdown-timeout`, 30 s by default) and raises SignalException; the agent of another node, whose workers stopped
with 143 because a peer's were signalled, raises ChildFailedError. A hang that the watchdog names ends every worker
with 124 (distributed/watchdog.py), and the agent raises ChildFailedError too. All end in exit 1, which Kubernetes'
`restartPolicy: ExitCode` (143 restarts the pod, 1-127 fail the job) reads as a failed job, and in which a scheduler
or a script cannot tell a hang from a crash. This runs torchrun's own `main` in this process (the same agent, the same
options) and exits 143 where the agent got SIGTERM, and the workers' code where every failed worker ended with the
same one of 143 (or killed by SIGTERM before its handler was installed) and 124; any other failure keeps torchrun's
exit code. A mistake of the user's, which every worker finds and rank 0 prints in one line (exit 2), ends in exit 2
without torchrun's traceback. Any other failure keeps torchrun's report, naming as its root cause the rank that
raised (torchrun's own names rank 0 where it stopped within the same second).
"""

from __future__ import annotations

import os
import signal
import sys

from torch.distributed import run
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from scaleup.callbacks.preemption import EXIT_PREEMPTED
from scaleup.errors import EXIT_USER_ERROR
from scaleup.observability.failure import EXIT_HUNG

# The workers' exit codes passed on, and what each says; a worker killed by SIGTERM counts as EXIT_PREEMPTED.
PASSED_ON = {
    EXIT_PREEMPTED: "pre-empted ({how}): exit {code}; resume with ckpt_path=last",
    EXIT_HUNG: "a rank hung ({how}: the watchdog named it above): exit {code}; resume with ckpt_path=last",
}


def workers_code(error: ChildFailedError) -> int | None:
    """The exit code every failed worker ended with, where it is one of PASSED_ON, else None."""
    codes = {EXIT_PREEMPTED if f.exitcode == -signal.SIGTERM else f.exitcode for f in error.failures.values()}
    return codes.pop() if len(codes) == 1 and codes <= PASSED_ON.keys() else None


def outcome(error: SignalException | ChildFailedError) -> tuple[int, str] | None:
    """(the exit code, how it came about) where torchrun's run ended in a pre-emption or a hang, else None: its agent
    got SIGTERM, or every failed worker ended with the same code of PASSED_ON."""
    if isinstance(error, SignalException):
        return (EXIT_PREEMPTED, "the agent got SIGTERM") if error.sigval == signal.SIGTERM else None
    code = workers_code(error)
    if code is None:
        return None
    return code, "its workers stopped on SIGTERM" if code == EXIT_PREEMPTED else f"every failed worker exited {code}"


def mistakes_unsaid(error: ChildFailedError) -> list[str] | None:
    """Where every failed worker exited EXIT_USER_ERROR (a mistake in one line: errors.exit_with, which only rank 0
    prints), the lines of the other ranks that differ from rank 0's, from the files they recorded; else None."""
    if {failure.exitcode for failure in error.failures.values()} != {EXIT_USER_ERROR}:
        return None
    said = error.failures[0].message if 0 in error.failures else None
    lines = [f.message for rank, f in sorted(error.failures.items()) if rank != 0 and isinstance(f.message, str)]
    return list(dict.fromkeys(line for line in lines if line.startswith("error: ") and line != said))


def root_cause_first(error: ChildFailedError) -> ChildFailedError:
    """`error` with the failures that recorded their error (the rank that raised: errors.record_for_launcher) before
    those that did not (the ranks that stopped because of it). torchrun names as the root cause the failure with the
    earliest timestamp, in whole seconds, the first one on a tie: rank 0, which stopped within the same second."""
    recorded = {rank: f for rank, f in error.failures.items() if os.path.isfile(f.error_file)}
    return ChildFailedError(error.name, {**recorded, **error.failures})


def main(argv: list[str] | None = None) -> None:
    """Run torchrun with `argv` (default: this command's arguments); exit 143 where it ended in a pre-emption, 124
    where its workers hung, 2 (the workers' one line, no traceback) on a mistake of the user's."""
    try:
        run.main(argv)
    except (SignalException, ChildFailedError) as error:
        unsaid = mistakes_unsaid(error) if isinstance(error, ChildFailedError) else None
        if unsaid is not None:
            print(*unsaid, sep="\n", file=sys.stderr, end="\n" if unsaid else "")
            sys.exit(EXIT_USER_ERROR)
        ended = outcome(error)
        if ended is None and isinstance(error, ChildFailedError):
            raise root_cause_first(error) from None
        if ended is None:
            raise
        code, how = ended
        print(f"torchrun: {PASSED_ON[code].format(how=how, code=code)}", file=sys.stderr)
        sys.exit(code)


if __name__ == "__main__":
    main()
