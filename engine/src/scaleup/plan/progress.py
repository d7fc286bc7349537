"""What the plan's steps count while a run trains: optimizer steps, or global batches under manual optimization.

Under automatic optimization the plan's step is Lightning's optimizer step (`trainer.global_step`): one per global
batch. Under manual optimization (`automatic_optimization = False`) the module steps its optimizers itself and
Lightning counts every `optimizer.step()` call in `global_step` (Lightning 2.6: a GAN's generator and discriminator
make it 2 per batch). The plan counts global batches there instead, so that the LR schedule, the step seed,
`trainer.max_steps` and a mid-epoch resume mean the same whatever the module steps per batch: the training batches
the fit loop has processed, from its batch progress (public counters, restored from a checkpoint on resume).
Lightning cannot accumulate gradients under manual optimization, and the plan refuses accumulation there
(`check_manual_optimization`), so a training batch is a global batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning as L

from scaleup.errors import UserError

if TYPE_CHECKING:
    from scaleup.plan.resolve import Plan


def steps_done(trainer: L.Trainer) -> int:
    """The plan's steps trained so far, read between two batches: in `on_train_batch_start`, those before this
    batch; when a resumed run builds its loaders, those its checkpoint trained.

    Under manual optimization it reads the fit loop's processed-batch counter (a read: nothing of the loop is
    written). `trainer.fit_loop.total_batch_idx` (its ready count less one) equals it only in
    `on_train_batch_start` (measured on Lightning 2.6.6); in `on_train_batch_end`, and when a run resumed from a
    checkpoint written there builds its loaders, it is one behind, but not for a checkpoint written inside a batch
    (ready counts that batch, processed does not): no fixed offset turns one into the other. `global_step` counts
    `optimizer.step()` calls there."""
    if trainer.lightning_module.automatic_optimization:
        return trainer.global_step
    return trainer.fit_loop.epoch_loop.batch_progress.total.processed


def checkpoint_steps(checkpoint: dict[str, Any], manual_optimization: bool) -> int:
    """The plan's steps a checkpoint trained (`steps_done` when it was written)."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
    if manual_optimization and progress:
        return progress["total"]["processed"]
    return checkpoint.get("global_step", 0)


def check_manual_optimization(module: str, plan: Plan, accumulation_set: int | None) -> None:
    """Lightning refuses accumulation under manual optimization only once fit has started, in a traceback: refuse
    it before anything starts, naming the setting that asks for it."""
    why = (
        f"{module} sets automatic_optimization=False, and Lightning cannot accumulate gradients under manual "
        "optimization"
    )
    if plan.max_per_device_batch_size == "auto":
        raise UserError(
            f"data.max_per_device_batch_size=auto derives a gradient accumulation, but {why}: give the cap as a "
            "number that the per-device share of the global batch fits in, or drop it"
        )
    if accumulation_set is not None and accumulation_set > 1:
        raise UserError(
            f"trainer.accumulate_grad_batches={accumulation_set}, but {why}: remove it: each device then "
            "computes its whole share of the global batch at once"
        )
    if plan.accumulate_grad_batches > 1:
        share = plan.global_batch_size // plan.world_size
        raise UserError(
            f"data.global_batch_size={plan.global_batch_size} on {plan.world_size} device(s) is {share} samples per "
            f"device, above data.max_per_device_batch_size={plan.max_per_device_batch_size}: the cap derives "
            f"{plan.accumulate_grad_batches} accumulation steps, but {why}. Run on "
            f"{plan.world_size * plan.accumulate_grad_batches} devices, raise the cap to {share}, or lower the global "
            "batch"
        )


class StopAtPlannedSteps(L.Callback):
    """Under manual optimization, ends training after the plan's `total_steps` global batches: `trainer.max_steps`
    counts batches there, where Lightning's own limit would count `optimizer.step()` calls (the Trainer gets none)."""

    def __init__(self, total_steps: int) -> None:
        self.total_steps = total_steps

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if steps_done(trainer) >= self.total_steps:
            trainer.should_stop = True
