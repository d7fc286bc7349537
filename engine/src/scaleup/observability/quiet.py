"""Messages of Lightning and torch that a run would print and its user cannot act on, each silenced at its source: a
filter for that one message from the one module that emits it, never a blanket filter. Measured on Lightning 2.6.6
and torch 2.14.1; a release that rewords one shows it again, and engine/tests/test_train_e2e.py
(test_a_default_run_prints_only_what_to_act_on) and test_plain_logging.py (on 2 processes) fail on it.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

from lightning.pytorch.utilities.rank_zero import rank_zero_module

# (the module that warns, the start of its message), for warnings.filterwarnings (regular expressions); each once
# per process, so once per rank.
WARNINGS = (
    # torch deprecates the LeafSpec that Lightning's CombinedLoader builds for every loader.
    (r"lightning\.pytorch\.utilities\._pytree", r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
    # torch deprecates the autograd all_gather behind Lightning's `strategy.all_gather` (the diagnostics' one per
    # epoch; a module's own `self.all_gather` too).
    (r"lightning\.fabric\.utilities\.distributed", r"torch\.distributed\.nn\.functional\.all_gather is deprecated"),
    # Every resume's: a checkpoint directory that holds a run is resumed or refused before the Trainer is built
    # (checkpoints/resume.py check_run_dir), never written into by a new run.
    (r"lightning\.pytorch\.callbacks\.model_checkpoint", r"Checkpoint directory .* exists and is not empty"),
)
# torch.distributed.checkpoint's load saying that it assumes one process: the engine reads a sharded checkpoint on
# one process without a process group on purpose (`no_dist=True`), in eval, export, a resume and init.weights=.
ONE_PROCESS_LOAD = r"torch\.distributed is disabled, unavailable or uninitialized"
# Lightning's advice to log with `sync_dist=True`, given the first time it computes an epoch value that each rank
# holds its own. At an evaluation's end on several processes the engine has made such a value exact, or names it in
# a warning of its own (callbacks/exact_metrics.py); the advice would average uneven ranks' values unweighted.
SYNC_DIST_ADVICE = r"It is recommended to use `self\.log\("
# Lightning's advertisement for its cloud logger, at every Trainer's start: (module, start of the message).
LITLOGGER_TIP = ("logger_connector", "💡 Tip: For seamless cloud logging")
# Said when `trainer.test` after `trainer.fit` attaches the module's `configure_callbacks` again: they replace
# their own copies from fit (at fit itself the same line names a callback of the Trainer's, and stays).
REATTACHED = ("callback_connector", "The following callbacks returned in `LightningModule.configure_callbacks`")


class DropMessages(logging.Filter):
    """Drops the records of Lightning's rank-zero logger that come from `module` and start with `start`."""

    def __init__(self, *messages: tuple[str, str]) -> None:
        super().__init__()
        self.messages = messages

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(
            record.module == module and record.getMessage().startswith(start) for module, start in self.messages
        )


_TIPS = DropMessages(LITLOGGER_TIP)


def quiet() -> None:
    """Installs the filters, in each process that builds a Trainer (a launched rank runs the job again); calling it
    again adds nothing."""
    for module, message in WARNINGS:
        warnings.filterwarnings("ignore", message=message, module=module)
    rank_zero_module.log.addFilter(_TIPS)


@contextlib.contextmanager
def quiet_reattached_callbacks() -> Iterator[None]:
    """Around a `trainer.test` after `trainer.fit` on the same Trainer: no line about the module's callbacks
    replacing their copies from fit."""
    drop = DropMessages(REATTACHED)
    rank_zero_module.log.addFilter(drop)
    try:
        yield
    finally:
        rank_zero_module.log.removeFilter(drop)


@contextlib.contextmanager
def quiet_one_process_load() -> Iterator[None]:
    """Around `torch.distributed.checkpoint.load(..., no_dist=True)`: no warning that it loads in one process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ONE_PROCESS_LOAD, UserWarning)
        yield


class QuietBetweenHooks:
    """Warnings that start with `message` (a regular expression) ignored from `start()` to `stop()`: from one of
    Lightning's hooks to a later one, which no `with` block spans. `stop()` puts the filters back as they were at
    `start()` (warnings.catch_warnings): a filter added in between is dropped with it."""

    def __init__(self, message: str) -> None:
        self.message = message
        self._window: warnings.catch_warnings | None = None

    def start(self) -> None:
        if self._window is None:
            self._window = warnings.catch_warnings()
            self._window.__enter__()
            warnings.filterwarnings("ignore", message=self.message)

    def stop(self) -> None:
        if self._window is not None:
            window, self._window = self._window, None
            window.__exit__(None, None, None)
