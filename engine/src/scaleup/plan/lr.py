"""The LR plan: the peak LR for the global batch (linear, sqrt), warmup and decay, as a factor of the optimizer step."""

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import lightning as L
from torch.optim import Optimizer

from scaleup.errors import UserError

SCALING_RULES = ("linear", "sqrt", "none")
DECAYS = ("cosine", "step", "none")


def lr_factor(global_batch: int, base_batch: int, rule: str) -> float:
    """How much larger the peak LR is than the base LR tuned at `base_batch`: Goyal et al. 2017 (linear),
    Krizhevsky 2014 / Hoffer et al. 2017 (sqrt)."""
    ratio = global_batch / base_batch
    if rule == "linear":
        return ratio
    if rule == "sqrt":
        return math.sqrt(ratio)
    if rule == "none":
        return 1.0
    raise UserError(f"lr_schedule.rule={rule} is not one of {', '.join(SCALING_RULES)}")


@dataclass(frozen=True)
class LRSchedule:
    """The factor on every base LR as a pure function of the optimizer step: resume needs only the global step."""

    peak: float  # factor at the end of warmup: lr_factor(global batch, base batch, rule)
    warmup_steps: int  # 0 unless peak > 1 (plan/resolve.py warmup_steps_for)
    total_steps: int
    decay: str = "cosine"
    milestones: tuple[int, ...] = ()  # optimizer steps, for decay="step"
    gamma: float = 0.1

    def __post_init__(self) -> None:
        if self.warmup_steps and self.peak <= 1:
            raise ValueError(f"a warmup of {self.warmup_steps} steps needs a peak above the base LR, not x{self.peak}")

    def factor_at(self, step: int) -> float:
        """The factor on every base LR at optimizer step `step`: the warmup ramps from the unscaled base LR (1) to
        the peak (Goyal et al. 2017, "gradual warmup"), then the decay runs from the peak over the remaining steps."""
        if step < self.warmup_steps:
            return 1.0 + (self.peak - 1.0) * step / self.warmup_steps
        if self.decay == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            progress = min(1.0, (step - self.warmup_steps) / span)
            return self.peak * 0.5 * (1.0 + math.cos(math.pi * progress))
        if self.decay == "step":
            return self.peak * self.gamma ** sum(step >= m for m in self.milestones)
        return self.peak


def base_lrs(module: L.LightningModule, trainer: L.Trainer) -> dict[str, float]:
    """Each param group's LR as the module's `configure_optimizers` sets it (lr_groups), `module` attached to
    `trainer` (attached_trainer); refuses a returned LR scheduler (refuse_scheduler).

    A dry run's, on its probe Trainer (trainer.check_trainer_arguments): it calls `configure_optimizers` itself, its
    only call (a dry run fits nothing). A run reads the same from the optimizers Lightning built when fit starts
    (callbacks/lr_scaling.py, callbacks/run_files.py).
    """
    with attached_trainer(module, trainer):
        returned = module.configure_optimizers()
    if returned is None:  # Lightning allows it: a module that steps no optimizer
        return {}
    optimizers, schedulers = optimizers_and_schedulers(returned)
    if schedulers:
        refuse_scheduler(module, schedulers[0]["scheduler"] if isinstance(schedulers[0], dict) else schedulers[0])
    return lr_groups(optimizers)


def lr_groups(optimizers: list[Optimizer]) -> dict[str, float]:
    """Each param group's LR, named like LearningRateMonitor's tags (`SGD/head`, or `SGD/pg1` for a group without a
    "name"; a second optimizer of the same class `SGD-1/pg1`)."""
    names = [type(optimizer).__name__ for optimizer in optimizers]
    # The n-th repeat of a class is `<class>-n`, as LearningRateMonitor names it: two SGDs (a GAN's) keep both LRs.
    names = [name + (f"-{names[:i].count(name)}" if name in names[:i] else "") for i, name in enumerate(names)]
    return {
        f"{name}/{group.get('name', f'pg{index + 1}')}": float(group["lr"])
        for name, optimizer in zip(names, optimizers, strict=True)
        for index, group in enumerate(optimizer.param_groups)
    }


def refuse_scheduler(module: L.LightningModule, scheduler: Any) -> None:
    """Refuse the LR scheduler `module.configure_optimizers` returned: one UserError."""
    raise UserError(
        f"{type(module).__name__}.configure_optimizers returns a learning-rate scheduler "
        f"({type(scheduler).__name__}), which would fight the template's own schedule: return only the optimizer "
        "and set lr_schedule.rule, warmup_epochs (or warmup_steps), decay=cosine|step|none, milestones and gamma "
        "instead"
    )


@contextlib.contextmanager
def attached_trainer(module: L.LightningModule, trainer: L.Trainer) -> Iterator[None]:
    """`module`, which no Trainer holds yet, attached to `trainer` (one process) for a `configure_optimizers`
    that reads `self.trainer` (`self.trainer.model.parameters()`, as lightning-hydra-template's modules do)."""
    trainer.strategy.connect(module)
    module.trainer = trainer
    try:
        yield
    finally:
        module.trainer = None


def optimizers_and_schedulers(returned: Any) -> tuple[list[Optimizer], list[Any]]:
    """(optimizers, LR schedulers) from what `configure_optimizers` returned, in each format Lightning's documentation
    lists: an optimizer, a list of them, a dict with "optimizer" and "lr_scheduler", a list of such dicts, or
    (optimizers, schedulers)."""
    if isinstance(returned, Optimizer):
        return [returned], []
    if isinstance(returned, dict):
        return [returned["optimizer"]], [returned["lr_scheduler"]] if "lr_scheduler" in returned else []
    if isinstance(returned, tuple) and len(returned) == 2 and all(isinstance(part, list) for part in returned):
        return list(returned[0]), list(returned[1])
    parsed = [optimizers_and_schedulers(item) for item in returned]
    return [o for optimizers, _ in parsed for o in optimizers], [s for _, schedulers in parsed for s in schedulers]
