"""TensorBoard summaries written past Lightning's logger."""

from __future__ import annotations

from typing import Any


def add_summaries(logger: Any, summaries: list[Any], step: int) -> None:
    """Write raw Summary protos (TensorBoard's HParams) into a TensorBoardLogger's event files, and flush.

    Lightning 2.6.6, torch 2.14.1. Reason: `TensorBoardLogger.log_hyperparams(params, metrics)` also writes each
    metric as a scalar (a second point on every curve), and torch's SummaryWriter has no public method that takes a
    Summary: its open `file_writer` (a public attribute) does, or, where Lightning closed it after a stage, a
    `FileWriter` of their own into the same directory (TensorBoard reads every event file of a run directory).
    Canary: test_log_hyperparams_with_metrics_adds_a_scalar_point.
    """
    from torch.utils.tensorboard.writer import FileWriter

    experiment = logger.experiment
    writer = experiment.file_writer or FileWriter(experiment.get_logdir())
    for summary in summaries:
        writer.add_summary(summary, step)
    writer.flush()
    if writer is not experiment.file_writer:
        writer.close()
