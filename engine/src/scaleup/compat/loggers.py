"""TensorBoard summaries written past Lightning's logger."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("scaleup")


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
