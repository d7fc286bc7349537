"""Fixes to Lightning 2.6's own code, written as the upstream patch would be, for the releases that need them.

Imported only where a fix is installed, after its gate (compat/gates.py) has checked the private names it relies on:
the fit loop for a Lightning in `AFFECTED` (`gates.EPOCH_END_RESUME`), the signal connector wherever
`gates.SIGTERM_HANDLER` passes. Each fix names its canary in
engine/tests/test_lightning_workarounds.py, which shows that plain Lightning still has the bug; when a release fixes
it, the canary fails: narrow `AFFECTED` to the releases before it (and delete this file once none is supported).
"""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from packaging.specifiers import SpecifierSet

#: The Lightning releases whose fit loop re-enters a finished epoch on a resume with max_steps.
AFFECTED = SpecifierSet(">=2.6,<2.7")


class FitLoop(_FitLoop):
    """Lightning's fit loop, with the `restarting` setter of a resume with `trainer.max_steps` fixed.

    Lightning 2.6 restores every run with max_steps as one to continue inside its last epoch
    (`restarting and epoch_unfinished or self._iteration_based_training()`): resumed from a checkpoint written at the
    end of an epoch that ran to its end (last.ckpt is), the loop re-enters the finished epoch, trains one batch past
    its end, and counts the epoch done a second time: the run trains one epoch fewer than without max_steps
    (measured on digits, 19 steps per epoch, from step 19: max_epochs=3 max_steps=40 ended at step 38).
    The fix restarts inside the epoch only where it did not end: its counters say it is unfinished, or max_steps
    stopped it before its last batch (which Lightning counts as a processed epoch all the same).
    Canary: test_max_steps_resume_from_an_epoch_end_reenters_the_finished_epoch.
    """

    @_FitLoop.restarting.setter
    def restarting(self, restarting: bool) -> None:
        epoch = self.epoch_progress.current
        epoch_unfinished = any(count != epoch.processed for count in (epoch.ready, epoch.started))
        cut_short = self.max_steps != -1 and not self.epoch_loop.batch_progress.is_last_batch
        # The setter of the loop class above Lightning's fit loop: it passes the value on to the child loops.
        super(_FitLoop, type(self)).restarting.fset(self, restarting and (epoch_unfinished or cut_short))


def install_fit_loop(trainer: L.Trainer) -> None:
    """Give `trainer` the fixed fit loop, before it fits: the same limits and the same epoch loop, as the Trainer
    builds its own (the limits are set again from the Trainer's at the start of each `fit`)."""
    built = trainer.fit_loop
    trainer.fit_loop = FitLoop(trainer, min_epochs=built.min_epochs, max_epochs=built.max_epochs)
    trainer.fit_loop.epoch_loop = built.epoch_loop


class SignalConnector(_SignalConnector):
    """Lightning's signal connector, with the handler of the job (`install`) put back in front of Lightning's own
    SIGTERM handler as soon as Lightning registers it, at each stage's start.

    Lightning 2.6 registers its SIGTERM handler after `setup`, and that handler runs a `dist.broadcast` inside the
    signal handler (which can interleave with the step's collectives and hang) and stops its own rank alone. A stage's
    first callback hook comes only after the process group's barrier and the loaders' set-up: a signal in between
    would reach Lightning's handler. Its SIGUSR1 handler (SLURM's requeue) is left as it is.
    Canary: test_lightning_registers_its_own_sigterm_handler_after_setup.
    """

    def __init__(self, trainer: L.Trainer, install: Callable[[], None]) -> None:
        super().__init__(trainer)
        self.install = install

    def register_signal_handlers(self) -> None:
        super().register_signal_handlers()
        self.install()


def install_signal_connector(trainer: L.Trainer, install: Callable[[], None]) -> None:
    """Give `trainer` the signal connector above, before its stage registers its handlers (a callback's `setup`)."""
    trainer._signal_connector = SignalConnector(trainer, install)
