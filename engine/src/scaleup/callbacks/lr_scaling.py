"""The LR schedule applied: a factor on each param group's own LR, set before every optimizer step (StepPlan, in
callbacks/step_plan.py, calls it)."""

from typing import Any

import lightning as L

from scaleup.plan.lr import LRSchedule, refuse_scheduler


class LRScaling:
    """Before each batch, sets every param group's LR to its own base LR x `schedule.factor_at(step)` where the factor
    changed since the step before, `step` being the plan's steps done (`plan/progress.py`: optimizer steps, or global
    batches under manual optimization, where every optimizer the module steps follows the schedule per batch).

    The base LR of a group is the one `configure_optimizers` gave it, so ratios between groups (a backbone at
    0.1x the head) hold through scaling, warmup and decay. It is read in `on_fit_start`, which Lightning calls
    after `configure_optimizers` and before it restores a checkpoint's optimizer state: a resumed run's param
    groups come back with the LR last set, never mistaken for a base LR. The factor is a pure function of the
    global step, not state carried in a torch scheduler: a resumed run continues the warmup or decay exactly,
    and with gradient accumulation all micro-batches of a step see the same LR.
    StepPlan comes before LearningRateMonitor so the logged LR is the one used for the step, and before RunFiles:
    a returned LR scheduler, which would fight the schedule, is refused here first (one line, before any step).
    """

    def __init__(self, schedule: LRSchedule) -> None:
        self.schedule = schedule
        self.base_lrs: list[list[float]] = []
        self._groups: list[tuple[dict[str, Any], float]] = []  # (param group, its base LR), flat
        self._step: int | None = None
        self._factor: float | None = None  # the factor the param groups hold

    def read_base_lrs(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """At the start of fit: the LRs `configure_optimizers` gave, before a checkpoint's optimizer state."""
        if trainer.lr_scheduler_configs:
            refuse_scheduler(pl_module, trainer.lr_scheduler_configs[0].scheduler)
        self.base_lrs = [[group["lr"] for group in optimizer.param_groups] for optimizer in trainer.optimizers]

    def attach(self, trainer: L.Trainer) -> None:
        """At the start of training, after a checkpoint's optimizer state is loaded (it replaces every param group
        dict): the groups to set."""
        self._groups = [
            (group, base_lr)
            for optimizer, base_lrs in zip(trainer.optimizers, self.base_lrs, strict=True)
            for group, base_lr in zip(optimizer.param_groups, base_lrs, strict=True)
        ]
        self._step = self._factor = None

    def set_for(self, step: int) -> None:
        """Before a training batch of optimizer step `step` (the plan's steps done)."""
        if step == self._step:  # the next micro-batch of an accumulated step: set already
            return
        self._step = step
        factor = self.schedule.factor_at(step)
        if factor == self._factor:  # a constant stretch of the schedule: the groups hold it already
            return
        self._factor = factor
        for group, base_lr in self._groups:
            group["lr"] = base_lr * factor
