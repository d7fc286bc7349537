"""The default progress bar: Lightning's Rich bar, given a training step's count and metrics only as often as it
draws them."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar


class SteadyRichProgressBar(RichProgressBar):
    """Lightning's RichProgressBar whose training bar takes a step's count and metrics at most `refresh_rate` times a
    second, and always at the epoch's last batch and the run's last step.

    Rich draws the bar `refresh_rate` times a second from a thread of its own, while Lightning's bar reads the logged
    metrics and updates its task after every training step (about 0.1 ms of Python): at steps of a few ms, most of
    those updates are never drawn. The other hooks are Lightning's."""

    def __init__(self, refresh_rate: int = 4, **kwargs: Any) -> None:
        super().__init__(refresh_rate=refresh_rate, **kwargs)
        self._next_update = 0.0

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.monotonic()
        last = batch_idx + 1 >= trainer.num_training_batches or 0 < trainer.max_steps <= trainer.global_step
        if now < self._next_update and not last:
            return
        if self.is_enabled:  # refresh_rate=0 turns Lightning's bar off
            self._next_update = now + 1 / self.refresh_rate
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
