"""When Lightning hands a step's values to the loggers, and TensorBoard summaries written past Lightning's logger."""

from __future__ import annotations

import logging
from typing import Any

import lightning as L

log = logging.getLogger("scaleup")


def is_logging_step(trainer: L.Trainer) -> bool:
    """Whether Lightning hands this training step's values to the loggers (every `log_every_n_steps` steps).

    Lightning 2.6.6. Reason: Lightning keeps this rule in the private `trainer._logger_connector.should_update_logs`
    and exposes no public test; reading it there keeps the per-step metrics and the progress bar in step with it.
    Canary: test_should_update_logs_follows_log_every_n_steps. Where that is gone, every step counts as one (the
    loggers still write only theirs: the same curves, at a few us more a step).
    """
    connector = getattr(trainer, "_logger_connector", None)
    return getattr(connector, "should_update_logs", True) or bool(trainer.fast_dev_run)


def add_summaries(logger: Any, summaries: list[Any], step: int) -> None:
    """Write raw Summary protos (TensorBoard's HParams) into a TensorBoardLogger's event file, and flush.

    Lightning 2.6.6, torch 2.14.1. Reason: `TensorBoardLogger.log_hyperparams(params, metrics)` also writes each
    metric as a scalar (a second point on every curve), and torch's SummaryWriter takes summaries only through its
    private `_get_file_writer()` (which also reopens a writer Lightning closed after fit).
    Canary: test_log_hyperparams_with_metrics_adds_a_scalar_point. Where that is gone, the HParams tab is not
    written, with one warning (the scalars and metrics.json are).
    """
    get_writer = getattr(logger.experiment, "_get_file_writer", None)
    if get_writer is None:
        log.warning("TensorBoard's HParams tab is not written: torch's SummaryWriter has no _get_file_writer")
        return
    writer = get_writer()
    for summary in summaries:
        writer.add_summary(summary, step)
    writer.flush()
