"""The plan in every process that trains or evaluates: the speed settings at set-up, then before each training
micro-batch the LR of its optimizer step (callbacks/lr_scaling.py) and the seed of its place in the global batch
(callbacks/step_seed.py). One callback, so that a step pays for one hook and one count of the steps done."""

from __future__ import annotations

from typing import Any

import lightning as L

from scaleup.callbacks.lr_scaling import LRScaling
from scaleup.callbacks.performance import apply_speed_settings
from scaleup.callbacks.step_seed import StepSeed
from scaleup.plan.progress import steps_done


class StepPlan(L.Callback):
    """Applies the plan's `tf32` and `channels_last` in `setup`; in training, with `lr` and `seed`, the LR schedule
    and the step's seed before each micro-batch. It comes before the user's callbacks: LearningRateMonitor logs the LR
    the step uses, and a callback draws from the micro-batch's seeded stream."""

    def __init__(
        self, tf32: bool, channels_last: bool, lr: LRScaling | None = None, seed: StepSeed | None = None
    ) -> None:
        self.tf32, self.channels_last = tf32, channels_last
        self.lr, self.seed = lr, seed

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        apply_speed_settings(trainer, pl_module, self.tf32, self.channels_last)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.lr is not None:
            self.lr.read_base_lrs(trainer, pl_module)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.lr is not None:
            self.lr.attach(trainer)
        if self.seed is not None:
            self.seed.attach(trainer, pl_module)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = steps_done(trainer)
        if self.lr is not None:
            self.lr.set_for(step)
        if self.seed is not None:
            self.seed.seed_for(step)
