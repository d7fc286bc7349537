"""A Rich progress bar whose cost per step does not depend on how fast the steps are."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar

from scaleup.observability.metrics import is_logging_step


class ThrottledRichProgressBar(RichProgressBar):
    """Lightning's RichProgressBar, updated at most `refresh_per_second` times a second during training.

    Lightning's bar updates its task and reads the progress-bar metrics after every training batch and draws from
    a thread up to `refresh_rate` (100) times a second: at 10 ms steps that is a share of every step. This one
    skips a batch's update unless a draw is due (or it is the epoch's last batch), and draws at the same bounded
    rate. The step values named in `step_metrics` (logged without `prog_bar`, because Lightning reads every
    progress-bar step value back to the host after every step, which waits for the GPU) are read at logging steps
    only, when the loggers read them anyway. Evaluation bars are Lightning's, drawn at the same bounded rate.
    """

    def __init__(
        self, refresh_per_second: float = 4.0, step_metrics: Sequence[str] = ("train/loss_step",), **kwargs: Any
    ) -> None:
        super().__init__(refresh_rate=refresh_per_second, **kwargs)  # Lightning's refresh_rate: draws per second
        self.interval = 1.0 / refresh_per_second
        self.step_metrics = tuple(step_metrics)
        self._step_values: dict[str, float] = {}
        self._next_update = 0.0

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.step_metrics and is_logging_step(trainer):
            logged = trainer.callback_metrics
            self._step_values = {name: float(logged[name]) for name in self.step_metrics if name in logged}
        now = time.monotonic()
        if now < self._next_update and not trainer.is_last_batch:
            return
        self._next_update = now + self.interval
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        return {**super().get_metrics(trainer, pl_module), **self._step_values}
