"""Scaled learning rate with warmup and decay, set before every optimizer step."""

import math
from dataclasses import dataclass
from typing import Any

import lightning as L

from scaleup.engine.errors import UserError

SCALING_RULES = ("linear", "sqrt", "none")
DECAYS = ("cosine", "step", "none")


def scaled_lr(base_lr: float, global_batch: int, base_batch: int, rule: str) -> float:
    """Peak LR for a global batch: Goyal et al. 2017 (linear), Krizhevsky 2014 / Hoffer et al. 2017 (sqrt)."""
    ratio = global_batch / base_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    if rule == "none":
        return base_lr
    raise UserError(f"callbacks.lr_scaling.rule={rule} is not one of {', '.join(SCALING_RULES)}")


@dataclass(frozen=True)
class LRSchedule:
    """LR as a pure function of the optimizer step: resume needs nothing but the global step."""

    base_lr: float
    peak_lr: float
    warmup_steps: int
    total_steps: int
    decay: str = "cosine"
    milestones: tuple[int, ...] = ()  # optimizer steps, for decay="step"
    gamma: float = 0.1

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            # Linear ramp from the unscaled base LR: the first steps of a big-batch run see the LR that
            # the base recipe was tuned for (Goyal et al. 2017, "gradual warmup").
            return self.base_lr + (self.peak_lr - self.base_lr) * step / self.warmup_steps
        if self.decay == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            progress = min(1.0, (step - self.warmup_steps) / span)
            return self.peak_lr * 0.5 * (1.0 + math.cos(math.pi * progress))
        if self.decay == "step":
            return self.peak_lr * self.gamma ** sum(step >= m for m in self.milestones)
        return self.peak_lr


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
