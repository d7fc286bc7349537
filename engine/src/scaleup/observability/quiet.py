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
from typing import Any

from lightning.pytorch.callbacks import RichModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import get_formatted_model_size, get_human_readable_count
from lightning.pytorch.utilities.rank_zero import rank_zero_module

# (the module that warns, the start of its message), for warnings.filterwarnings (regular expressions); each once
# per process, so once per rank.
WARNINGS = (
    # torch deprecates the LeafSpec that Lightning's CombinedLoader builds for every loader.
    (r"lightning\.pytorch\.utilities\._pytree", r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
    # torch deprecates the autograd all_gather behind Lightning's `strategy.all_gather` (the diagnostics' one per
    # epoch; a module's own `self.all_gather` too).
    (r"lightning\.fabric\.utilities\.distributed", r"torch\.distributed\.nn\.functional\.all_gather is deprecated"),
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


class SummaryWithoutUncountedFlops(RichModelSummary):
    """Lightning's rich model summary, without its FLOPs column and `Total FLOPs: 0` when it counted none.

    Lightning counts FLOPs only by running the module's `example_input_array`; for a module without one (the
    template's, and most) it prints 0 for every layer and in total, which reads as a measurement. With FLOPs
    counted, this is Lightning's own table. (TrainingDiagnostics' `flops: true` counts them on a real batch.)
    """

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        """Lightning's table with FLOPs counted; else its columns but FLOPs, and its totals on one line."""
        if total_flops:
            RichModelSummary.summarize(
                summary_data,
                total_parameters,
                trainable_parameters,
                model_size,
                total_training_modes,
                total_flops,
                **summarize_kwargs,
            )
            return
        from rich import get_console
        from rich.table import Table

        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:
            table.add_column(name, justify="right" if name.startswith("Params") else "left")
        for row in zip(*(values for _, values in columns), strict=True):
            table.add_row(*row)
        console = get_console()
        console.print(table)

        def count(number: int) -> str:
            return get_human_readable_count(number).strip()

        console.print(
            f"params: {count(trainable_parameters)} trainable, {count(total_parameters - trainable_parameters)} "
            f"non-trainable, {count(total_parameters)} in all ({get_formatted_model_size(model_size)} MB); modules: "
            f"{total_training_modes['train']} in train mode, {total_training_modes['eval']} in eval mode",
            soft_wrap=True,
        )
