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
