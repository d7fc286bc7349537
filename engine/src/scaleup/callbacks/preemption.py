"""How a job ends other than by finishing: SIGTERM (a scheduler's "go now") stops every rank at the same step, saves
last.ckpt and exits 143, Ctrl-C (SIGINT) the same way with exit 130. On several processes, a rank that fails, hangs
or is killed is named and ends every rank: the failure watch's part (distributed/watchdog.py's JobWatch).

Schedulers (SLURM, Kubernetes, torchrun's agent) send SIGTERM, then SIGKILL after a grace period. `JobControl`
(which replaces Lightning's own handling) stops every rank after the same micro-batch and writes last.ckpt there;
the jobs wrap `fit` and `test` in `exit_when_stopped`, which exits 143 (never 0 without results), so
`ckpt_path=last` continues the run.
"""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException

from scaleup.callbacks.nonfinite import FirstNonFiniteLoss, nonfinite_loss_error
from scaleup.errors import EXIT_USER_ERROR, as_user_error
from scaleup.observability.failure import EXIT_FAILED, dump_stacks, exit_now, report, to_log_file, write_failure

log = logging.getLogger("scaleup")

# How a job that did not finish exits (every rank of it):
EXIT_PREEMPTED = 143  # 128 + SIGTERM, the shell's convention for "terminated"
EXIT_INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C
# and, from observability/failure.py: EXIT_HUNG = 124 (as timeout(1): a rank made no progress within
# strategy.hang_timeout_minutes) and EXIT_FAILED = 1 (a rank raised, or died)
SIGTERM_GRACE_SECONDS = 30.0  # a rank that got SIGTERM and reaches no next step in this time exits on its own
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # each stops every rank at the next step, saving in training


def interrupted(err: BaseException) -> bool:
    """Whether `err` is Ctrl-C: a KeyboardInterrupt, or the exit 1 Lightning turns it into (after its shutdown)."""
    return isinstance(err, KeyboardInterrupt) or (
        isinstance(err, SystemExit) and isinstance(err.__context__, KeyboardInterrupt)
    )


@contextlib.contextmanager
def exit_when_stopped(stop: JobControl, resume_hint: str) -> Iterator[None]:
    """Exit 143 when the stage ends because of SIGTERM, also when it ended in another error after the signal
    (a peer that stopped first closes its connections: the collective this rank waited in fails); exit 130 with
    the same hint after Ctrl-C (SIGINT), saved as SIGTERM saves, or a KeyboardInterrupt (a second Ctrl-C). Rank 0
    says so, once for the job. The SIGTERM and SIGINT handlers the job found are put back when it ends: a process
    that trains twice (a notebook, a test session) and the processes it forks later still die on SIGTERM and stop
    on Ctrl-C."""
    main_thread = threading.current_thread() is threading.main_thread()
    found = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    try:
        yield
    except BaseException as err:
        ctrl_c = interrupted(err) or stop.signum == signal.SIGINT
        if not (ctrl_c or stop.requested or isinstance(err, SIGTERMException)):
            raise
        if rank_zero_only.rank == 0:
            log.warning(f"{'interrupted (Ctrl-C)' if ctrl_c else 'stopped by SIGTERM'}; {resume_hint}")
        sys.exit(EXIT_INTERRUPTED if ctrl_c else EXIT_PREEMPTED)
    finally:
        stop.finish()
        if main_thread:
            for signum, handler in found.items():
                signal.signal(signum, handler)


class FailureRecord(contextlib.AbstractContextManager):
    """Around a whole job: one that fails leaves why in its run directory, as the failure watch leaves it for a failing
    rank of several processes (which ends that process before this sees the error): rank 0 writes the traceback of
    a bug (or a user mistake's `error:` line) into the log file, and failure.json (what, ranks, exit_code,
    message). A bug in the user's code while the job builds (a LightningModule's `__init__`) counts; a mistake
    refused before the job `started` (a bad setting, a run directory that holds a run) writes nothing."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.started = False  # set as training starts: from then on a user mistake is recorded too (a NaN loss)

    def __exit__(self, kind: Any, err: BaseException | None, tb: Any) -> None:
        if not isinstance(err, Exception) or rank_zero_only.rank != 0:
            return  # finished, or a signal's exit (SystemExit) or Ctrl-C: exit_when_stopped said so
        if (joined := rendezvous_joined(err)) is not None:
            text = f"error: {rendezvous_failed(joined, self.run_dir)}"
            report(text)  # torch's traceback would only show where Lightning starts the process group
            write_failure(self.run_dir, "rendezvous", [], EXIT_FAILED, text)
            raise SystemExit(EXIT_FAILED) from None
        mistake = as_user_error(err)
        if mistake is not None and not self.started:
            return
        text = f"error: {mistake}" if mistake else "".join(traceback.format_exception(err)).rstrip()
        to_log_file(text)  # the terminal shows it already: Hydra's traceback, or exit_on_user_error's line
        write_failure(self.run_dir, "error", [0], EXIT_USER_ERROR if mistake else EXIT_FAILED, text)


def rendezvous_joined(err: BaseException) -> tuple[int, int] | None:
    """(processes joined, processes expected) where `err` is rank 0's rendezvous timing out (torch's store: "Timed
    out after N seconds waiting for clients. 1/2 clients joined."), else None."""
    found = re.search(r"(\d+)/(\d+) clients joined", str(err)) if isinstance(err, dist.DistStoreError) else None
    return None if found is None else (int(found[1]), int(found[2]))


def rendezvous_failed(joined: tuple[int, int], run_dir: Path) -> str:
    return (
        f"the processes did not all meet: {joined[0]} of {joined[1]} joined rank 0 within strategy.timeout_minutes; "
        "the others are slow or hung in their set-up (the data, the model) or never started. A rank left behind ends "
        f"by itself, its stack in {run_dir / 'hang'}; with strategy.hang_timeout_minutes set, a rank hung in its "
        "set-up is named sooner, with its stack"
    )


class JobControl(Callback):
    """Takes SIGTERM over from Lightning as soon as the process group exists, and stops every rank at the same point.

    Lightning 2.6.6. Reason: its handler runs a collective inside the signal handler (a broadcast that can
    interleave with the training step's and hang), a signal in `test` ends with SIGTERMException, a SystemExit
    without a code (exit 0, no results), and a signal on one rank stops that rank alone.
    Canary: test_sigterm_in_test_ends_plain_lightning_with_exit_code_0.

    Here the handler only sets a flag. It is installed in `setup`, right after Lightning starts the process group,
    and stays until the job ends, where `exit_when_stopped` puts back the one it found: Lightning's own, registered
    when each stage starts, is replaced at once (compat/lightning_2_6.py `SignalConnector`), and between stages
    Lightning restores the handler it found, this one.

    Training checks the flag at the end of every micro-batch (the last callback, so the others finish that batch;
    where a mid-epoch ModelCheckpoint saves too): on one process the flag itself, on several an all-reduce (max)
    of the ranks' flags, so a signal on any rank stops all of them after the same micro-batch, where it writes
    `<dirpath>/last.ckpt` (training only: given `dirpath`) so that `ckpt_path=last` continues from it (under SLURM,
    Lightning's own SIGUSR1 handler saves an `hpc_ckpt` and requeues the job). The all-reduce runs on the CPU
    (gloo) and in the background, read one micro-batch later: no device sync and no wait in the step, and the stop
    comes one micro-batch later.

    Evaluation batches are uneven across ranks: no per-batch collective may run there. Validation inside `fit`
    runs to its end and training stops after its next micro-batch. `test` (and `eval.py`, and `validate`) stops
    without saving (a test has nothing to resume): on one process after the batch of the signal; on several, the
    ranks agree once, at the end of each rank's last batch, before the epoch end's metric collectives
    (ExactEvalMetrics), in which a rank that had stopped alone would leave its peers with a closed connection. So
    a signal on any rank, also one between `fit` and `test`, stops every rank at the end of its share of the test.
    `exit_when_stopped` then exits 143. A rank that got SIGTERM and reaches no next batch or checkpoint within
    SIGTERM_GRACE_SECONDS (or `hang_timeout_minutes`, if shorter) writes its stacks to hang/rank<N>.txt and exits 143
    on its own: a rank stuck in the user's code, or in a collective with a rank that is gone, is never left running.

    `stop_on_nonfinite_loss`: a training loss that turns NaN or inf stops every rank with one line naming the step
    (callbacks/nonfinite.py), checked at logging steps, epoch ends and before each checkpoint is written (then none
    is), and instead of the save after a signal.
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        hang_timeout_minutes: float | None = None,
        stop_on_nonfinite_loss: bool = False,
    ) -> None:
        self.nonfinite = FirstNonFiniteLoss() if stop_on_nonfinite_loss else None
        self.path = f"{str(dirpath).rstrip('/')}/last.ckpt" if dirpath is not None else None  # a local path or a URL
        self.grace = min(SIGTERM_GRACE_SECONDS, 60 * hang_timeout_minutes if hang_timeout_minutes else float("inf"))
        self.ticks = 0  # batch starts and ends, checkpoints: after a signal, whether this rank still gets on
        self._overdue: threading.Timer | None = None  # ends a rank that does not stop after SIGTERM
        self.requested = False
        self.signum = 0  # the first stop signal received: SIGTERM or SIGINT
        self._trainer: L.Trainer | None = None
        self._ready = False  # set up once per job: the process group, the handler kept over Lightning's
        self._group: Any = None  # the CPU process group the flags travel in
        self._flag = torch.zeros(1)
        self._pending: Any = None  # the all-reduce in flight
        self._alone = True  # one process: the flag is the answer (set once, not read from the Trainer per step)

    def _on_signal(self, signum: int, frame: Any) -> None:
        callbacks = self._trainer.callbacks if self._trainer is not None else []
        if any(getattr(callback, "ending", False) for callback in callbacks):
            return  # the failure watch ends this rank already (torchrun's agent stops the ranks a hung one leaves)
        if signum == signal.SIGINT and self.signum == signal.SIGINT:  # Ctrl-C again: at once, as Python stops
            signal.default_int_handler(signum, frame)
        if not self.requested:
            self.signum = signum
            if rank_zero_only.rank == 0:  # a terminal's Ctrl-C (a scheduler's SIGTERM) reaches every rank: said once
                name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
                log.warning(
                    f"received {name}: every rank stops at the next step (training saves last.ckpt there)"
                    + ("; Ctrl-C again stops at once, without saving" if signum == signal.SIGINT else "")
                )
            launcher = self._trainer.strategy.launcher if self._trainer is not None else None
            # Lightning's own launcher: SIGTERM passed on to the processes it started (Ctrl-C reached them already,
            # and a second SIGINT would stop them at once)
            if launcher is not None and signum == signal.SIGTERM:
                launcher.kill(signum)
            self._overdue = threading.Timer(self.grace, self._stop_overdue, args=(self.ticks,))
            self._overdue.daemon = True
            self._overdue.start()
        self.requested = True

    def _stop_overdue(self, ticks: int) -> None:
        """The grace period after the signal ran out: a rank that made no progress since exits 143 (130 after
        Ctrl-C) with its stacks."""
        if self.ticks != ticks or self._trainer is None:
            return
        rank, code = self._trainer.global_rank, EXIT_INTERRUPTED if self.signum == signal.SIGINT else EXIT_PREEMPTED
        where = f"at step {self._trainer.global_step}"
        dump = dump_stacks(Path(self._trainer.default_root_dir), rank, where)
        report(
            f"rank {rank}: got {signal.Signals(self.signum).name} {self.grace:.0f} s ago and reached no next step: "
            f"exiting {code}; its stack: {dump}"
        )
        exit_now(code)

    def finish(self) -> None:
        """The job ended: stop the timer of a SIGTERM's grace period."""
        if self._overdue is not None:
            self._overdue.cancel()

    def _install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                signal.signal(signum, self._on_signal)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Lightning starts the process group just before `setup`, which every rank runs together.
        self._trainer = trainer
        self._install()
        if self._ready:
            return
        from scaleup.compat import lightning_2_6  # Lightning's private connector: imported once its gate passed

        lightning_2_6.install_signal_connector(trainer, self._install)  # ours stays in front of Lightning's handler
        self._alone = trainer.world_size == 1 or not dist.is_initialized()
        if not self._alone:
            # gloo runs on the CPU: NCCL's default group would sync the device.
            self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self._ready = True

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self.ticks += 1
        if self.nonfinite is not None:
            self.nonfinite.step = trainer.global_step

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop_on_nonfinite_loss()

    def on_save_checkpoint(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self.ticks += 1
        if trainer.state.fn == "fit":
            self._stop_on_nonfinite_loss()  # raised here, inside Trainer.save_checkpoint: nothing is written

    def _nonfinite_step(self) -> int | None:
        """The first step whose loss was NaN or inf on any rank (every rank gets the same answer), or None."""
        return None if self.nonfinite is None else self.nonfinite.first(self._group, distributed=not self._alone)

    def _stop_on_nonfinite_loss(self) -> None:
        if (step := self._nonfinite_step()) is not None:
            raise nonfinite_loss_error(step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self.ticks += 1
        if self.nonfinite is not None:
            self.nonfinite.record(args[1] if len(args) > 1 else kwargs.get("outputs"))
            # After the optimizer step of a logging step: Lightning reads the logged values back there anyway.
            if trainer.global_step != self.nonfinite.step and trainer.global_step % trainer.log_every_n_steps == 0:
                self._stop_on_nonfinite_loss()
        # At a batch's end, where a mid-epoch ModelCheckpoint saves too: the resume path proven exact.
        if self._agreed(trainer):
            raise SIGTERMException

    def on_test_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self.ticks += 1
        self._stop_evaluation(trainer.test_loop.batch_progress.is_last_batch)

    def on_validation_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self.ticks += 1
        if trainer.state.fn == "validate":  # inside fit, validation runs to its end
            self._stop_evaluation(trainer.validate_loop.batch_progress.is_last_batch)

    def _stop_evaluation(self, last_batch: bool) -> None:
        """Stops a test or a validation: one process at once; several when any rank asked, checked at the last
        batch (one collective per epoch, which every rank reaches, however many batches it has)."""
        if self.requested if self._alone else last_batch and self._any_rank_requested():
            raise SIGTERMException

    def _any_rank_requested(self) -> bool:
        flag = torch.tensor([float(self.requested)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

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

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self.path is not None and isinstance(exception, SIGTERMException) and trainer.state.fn == "fit":
            if (step := self._nonfinite_step()) is not None:  # no save of weights trained on it
                if trainer.is_global_zero:
                    log.error(f"error: {nonfinite_loss_error(step)}")
                return
            trainer.save_checkpoint(self.path)  # rank 0 writes, every rank waits at the barrier
            if trainer.is_global_zero:
                how = "interrupted (Ctrl-C)" if self.signum == signal.SIGINT else "stopped by SIGTERM"
                log.warning(f"{how} at step {trainer.global_step}; saved {self.path}")
