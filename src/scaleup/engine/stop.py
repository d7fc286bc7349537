"""A clean stop on SIGTERM, whatever the job is doing: every rank stops at the same point, exit code 143.

Schedulers (SLURM, Kubernetes, torchrun's agent) send SIGTERM, then SIGKILL after a grace period. Lightning's own
SIGTERM handling stops `fit` only: its signal handler runs a collective (a broadcast, inside the handler, which can
interleave with the one the training step is in, and hang), a signal during `test` ends the run with exit code 0
and no test results, and a signal that reaches one rank only stops that rank while the others wait for it.

Here the handler only sets a flag. Training checks it at the start of every micro-batch: an all-reduce (max) of
the ranks' flags, so a signal on any rank stops all of them at the same micro-batch, where `PreemptionCheckpoint`
writes last.ckpt. The all-reduce runs on the CPU (gloo) and in the background, read one micro-batch later: no
device sync and no wait in the step; the stop comes one micro-batch after the signal. Evaluation batches are
uneven across ranks (no per-batch collective may run there), so validation inside `fit` runs to its end and
training stops at its next micro-batch; `test` (and `eval.py`) stops at the next batch on each rank, without
saving: a test has nothing to resume. The job then exits 143 (128 + SIGTERM), never 0 without its results.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger("scaleup")

EXIT_PREEMPTED = 143  # 128 + SIGTERM, the shell's convention for "terminated"


class StopOnSigterm(L.Callback):
    """Takes SIGTERM over from Lightning at the start of every stage, and stops every rank at the same point."""

    def __init__(self) -> None:
        self.requested = False
        self._trainer: L.Trainer | None = None
        self._group: Any = None  # the CPU process group the flags travel in
        self._flag = torch.zeros(1)
        self._pending: Any = None  # the all-reduce in flight

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
        if trainer.world_size > 1 and dist.is_initialized():
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

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
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
        if trainer.world_size == 1 or not dist.is_initialized():
            return self.requested
        agreed = False
        if self._pending is not None:
            self._pending.wait()
            agreed = bool(self._flag.item())  # a CPU tensor: no device sync
        self._flag = torch.tensor([float(self.requested)])
        self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return agreed


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
