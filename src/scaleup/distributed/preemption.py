"""Pre-emption: SIGTERM (a scheduler's "go now") stops every rank at the same step, saves last.ckpt, exits 143.

Schedulers (SLURM, Kubernetes, torchrun's agent) send SIGTERM, then SIGKILL after a grace period. `StopOnSigterm`
(which replaces Lightning's own handling) stops every rank after the same micro-batch; `PreemptionCheckpoint`
writes last.ckpt there; the jobs wrap `fit` and `test` in `exit_when_stopped`, which exits 143 (never 0 without
results), so `ckpt_path=last` continues the run.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger("scaleup")

EXIT_PREEMPTED = 143  # 128 + SIGTERM, the shell's convention for "terminated"
EXIT_INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C


def interrupted(err: BaseException) -> bool:
    """Whether `err` is Ctrl-C: a KeyboardInterrupt, or the exit 1 Lightning turns it into (after its shutdown)."""
    return isinstance(err, KeyboardInterrupt) or (
        isinstance(err, SystemExit) and isinstance(err.__context__, KeyboardInterrupt)
    )


@contextlib.contextmanager
def exit_when_stopped(stop: StopOnSigterm, resume_hint: str) -> Iterator[None]:
    """Exit 143 when the stage ends because of SIGTERM, also when it ended in another error after the signal
    (a peer that stopped first closes its connections: the collective this rank waited in fails); exit 130 with
    the same hint after Ctrl-C."""
    try:
        yield
    except BaseException as err:
        if interrupted(err):
            log.warning(f"interrupted (Ctrl-C); {resume_hint}")
            sys.exit(EXIT_INTERRUPTED)
        if not (stop.requested or isinstance(err, SIGTERMException)):
            raise
        log.warning(f"stopped by SIGTERM; {resume_hint}")
        sys.exit(EXIT_PREEMPTED)


class StopOnSigterm(Callback):
    """Takes SIGTERM over from Lightning at the start of every stage, and stops every rank at the same point.

    Lightning 2.6.6. Reason: its handler runs a collective inside the signal handler (a broadcast that can
    interleave with the training step's and hang), a signal in `test` ends with SIGTERMException, a SystemExit
    without a code (exit 0, no results), and a signal on one rank stops that rank alone.
    Canary: test_sigterm_in_test_ends_plain_lightning_with_exit_code_0.

    Here the handler only sets a flag. Training checks it at the end of every micro-batch (the last callback, so
    the others finish that batch; where a mid-epoch ModelCheckpoint saves too): on one process the flag itself,
    on several an all-reduce (max) of the ranks' flags, so a signal on any rank stops all of them after the same
    micro-batch, where `PreemptionCheckpoint` writes last.ckpt. The all-reduce runs on the CPU (gloo) and in the
    background, read one micro-batch later: no device sync and no wait in the step, and the stop comes one
    micro-batch later. Evaluation batches are uneven across ranks (no per-batch collective may run there), so
    validation inside `fit` runs to its end and training stops after its next micro-batch; `test` (and
    `eval.py`) stops at the next batch on each rank, without saving: a test has nothing to resume.
    `exit_when_stopped` then exits 143.
    """

    def __init__(self) -> None:
        self.requested = False
        self._trainer: L.Trainer | None = None
        self._group: Any = None  # the CPU process group the flags travel in
        self._flag = torch.zeros(1)
        self._pending: Any = None  # the all-reduce in flight
        self._alone = True  # one process: the flag is the answer (set per fit, not read from the Trainer per step)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self.requested:
            log.warning(f"received signal {signum}: stopping at the next step")
            launcher = self._trainer.strategy.launcher if self._trainer is not None else None
            if launcher is not None:  # Lightning's own launcher: pass it on to the processes it started
                launcher.kill(signum)
        self.requested = True

    def _take_over(self, trainer: L.Trainer) -> None:
        # Lightning registers its handler when a stage starts, after `on_fit_start`; the first hook of each
        # stage runs after that, so this replaces it.
        self._trainer = trainer
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._take_over(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._take_over(trainer)
        self._alone = trainer.world_size == 1 or not dist.is_initialized()
        if not self._alone:
            # Every rank gets here together. gloo runs on the CPU: NCCL's default group would sync the device.
            self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._take_over(trainer)

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._take_over(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        # At a batch's end, where a mid-epoch ModelCheckpoint saves too: the resume path proven exact.
        if self._agreed(trainer):
            raise SIGTERMException

    def on_test_batch_start(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if self.requested:
            raise SIGTERMException

    def on_validation_batch_start(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if self.requested and trainer.state.fn == "validate":  # inside fit, validation runs to its end
            raise SIGTERMException

    def _agreed(self, trainer: L.Trainer) -> bool:
        """Whether any rank had been asked to stop by the previous micro-batch: the same answer on every rank."""
        if self._alone:
            return self.requested
        agreed = False
        if self._pending is not None:
            self._pending.wait()
            agreed = bool(self._flag.item())  # a CPU tensor: no device sync
        self._flag = torch.tensor([float(self.requested)])
        self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return agreed


class PreemptionCheckpoint(L.Callback):
    """On SIGTERM, Lightning finishes the current batch on every rank and raises SIGTERMException; this writes
    `last.ckpt` at that step so `ckpt_path=last` continues from it. (Under SLURM, Lightning's own SIGUSR1
    handler saves an `hpc_ckpt` and requeues the job.)"""

    def __init__(self, dirpath: str | Path) -> None:
        self.path = f"{str(dirpath).rstrip('/')}/last.ckpt"  # a local path or a URL

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException) and trainer.state.fn == "fit":
            trainer.save_checkpoint(self.path)  # rank 0 writes, every rank waits at the barrier
            if trainer.is_global_zero:
                log.warning(f"stopped by SIGTERM at step {trainer.global_step}; saved {self.path}")
