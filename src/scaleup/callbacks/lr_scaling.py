"""Scaled learning rate with warmup and decay, set before every optimizer step."""

from typing import Any

import lightning as L

from scaleup.distributed.plan import LRSchedule


class LRScaling(L.Callback):
    """Sets every param group's LR to `schedule.lr_at(trainer.global_step)` before each batch.

    The LR is a pure function of the global step, not state carried in a torch scheduler: a resumed run
    continues the warmup or decay exactly where it stopped (optimizer state restored from the checkpoint
    cannot overwrite it), and with gradient accumulation all micro-batches of a step see the same LR.
    Keep this callback before LearningRateMonitor so the logged LR is the one used for the step.
    """

    def __init__(self, schedule: LRSchedule) -> None:
        self.schedule = schedule

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        lr = self.schedule.lr_at(trainer.global_step)
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr
