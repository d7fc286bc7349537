"""A clean stop on SIGTERM, whatever the job is doing: exit code 143, never 0 without results.

Schedulers (SLURM, Kubernetes, torchrun's agent) send SIGTERM, then SIGKILL after a grace period. The Trainer's
`StopOnSigterm` callback (scaleup.engine.lightning_workarounds, as it replaces Lightning's own handling) stops every
rank at the same point; the job wraps `fit` and `test` in `exit_when_stopped`.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

from lightning.pytorch.utilities.exceptions import SIGTERMException

from scaleup.engine.lightning_workarounds import StopOnSigterm

log = logging.getLogger("scaleup")

EXIT_PREEMPTED = 143  # 128 + SIGTERM, the shell's convention for "terminated"


@contextlib.contextmanager
def exit_when_stopped(stop: StopOnSigterm, resume_hint: str) -> Iterator[None]:
    """Exit 143 when the stage ends because of SIGTERM, also when it ended in another error after the signal
    (a peer that stopped first closes its connections: the collective this rank waited in fails)."""
    try:
        yield
    except BaseException as err:
        if not (stop.requested or isinstance(err, SIGTERMException)):
            raise
        log.warning(f"stopped by SIGTERM; {resume_hint}")
        sys.exit(EXIT_PREEMPTED)
