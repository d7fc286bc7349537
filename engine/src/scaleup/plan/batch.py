"""Batch arithmetic: the global batch split into devices x accumulation x micro-batch, and the optimizer steps
an epoch and a run take (Lightning's debug flags included)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scaleup.errors import UserError

if TYPE_CHECKING:
    from scaleup.config.schema import TrainerArgs


@dataclass(frozen=True)
class BatchPlan:
    per_device: int
    accumulation: int
    world_size: int

    @property
    def global_(self) -> int:
        return self.per_device * self.accumulation * self.world_size


def resolve_batch(
    global_batch_size: int | None,
    per_device_batch_size: int | None,
    world_size: int,
    accumulation: int | None,
    max_per_device: int | None = None,
) -> BatchPlan:
    """per-device = global / (world_size x accumulation); an error naming the numbers if it does not divide.

    `accumulation` None means not set: 1, or with a per-device cap the smallest that keeps each device at or below
    it (`accumulation_for_cap`).
    """
    if (global_batch_size is None) == (per_device_batch_size is None):
        raise UserError(
            "set exactly one of data.global_batch_size (the recipe: same results on any device count) or "
            "data.per_device_batch_size (throughput mode: the global batch grows with devices); "
            f"got global={global_batch_size}, per_device={per_device_batch_size}. "
            "To switch, pass e.g. data.global_batch_size=null data.per_device_batch_size=64"
        )
    if max_per_device is not None:
        accumulation = accumulation_for_cap(
            global_batch_size, per_device_batch_size, world_size, accumulation, max_per_device
        )
    accumulation = accumulation or 1
    if per_device_batch_size is not None:
        return BatchPlan(int(per_device_batch_size), accumulation, world_size)
    shards = world_size * accumulation
    if global_batch_size % shards:
        raise UserError(
            f"data.global_batch_size={global_batch_size} does not divide into {world_size} device(s) x "
            f"{accumulation} accumulation step(s) = {shards} equal per-device batches; choose a global batch "
            f"that is a multiple of {shards} (e.g. {max(1, round(global_batch_size / shards)) * shards})"
        )
    return BatchPlan(global_batch_size // shards, accumulation, world_size)


def accumulation_for_cap(
    global_batch_size: int | None,
    per_device_batch_size: int | None,
    world_size: int,
    accumulation: int | None,
    cap: int,
) -> int:
    """The smallest accumulation that splits the global batch exactly into per-device batches of at most `cap`.

    One GPU with a cap of 32 runs an 8-GPU recipe of global batch 256 as 8 accumulation steps of 32: the same
    samples per optimizer step, so the same optimisation, in the memory of 32. A cap above the per-device share
    is no contradiction: it only bites on fewer devices, which is what lets one command run on any count.
    """
    if per_device_batch_size is not None:
        raise UserError(
            f"data.max_per_device_batch_size={cap} caps the per-device share of a fixed global batch, but "
            f"data.per_device_batch_size={per_device_batch_size} fixes the per-device batch itself; set "
            "data.global_batch_size instead (and data.per_device_batch_size=null), or drop the cap"
        )
    if global_batch_size % world_size:
        raise UserError(
            f"data.global_batch_size={global_batch_size} does not split evenly over {world_size} device(s), so no "
            f"accumulation gives equal per-device batches; choose a multiple of {world_size}"
        )
    share = global_batch_size // world_size
    derived = next(steps for steps in range(1, share + 1) if share % steps == 0 and share // steps <= cap)
    if accumulation is not None and accumulation != derived:
        raise UserError(
            f"trainer.accumulate_grad_batches={accumulation} contradicts data.max_per_device_batch_size={cap}: a "
            f"global batch of {global_batch_size} on {world_size} device(s) needs accumulation {derived} to keep "
            f"each device at or below {cap} ({share // derived} per device). Remove trainer.accumulate_grad_batches "
            "(the cap derives it) or the cap"
        )
    return derived


def check_auto_cap(per_device_batch_size: int | None, accumulation: int | None, strategy: str) -> None:
    """`max_per_device_batch_size=auto` derives the accumulation from a fixed global batch, on full replicas."""
    conflict = None
    if per_device_batch_size is not None:
        conflict = f"data.per_device_batch_size={per_device_batch_size} fixes the per-device batch itself"
    elif accumulation is not None:
        conflict = f"trainer.accumulate_grad_batches={accumulation} fixes the accumulation it would derive"
    elif strategy == "fsdp":
        conflict = "strategy=fsdp shards the model, and the probe measures one whole replica per device"
    if conflict:
        raise UserError(
            f"data.max_per_device_batch_size=auto finds the largest per-device share of a fixed global batch that "
            f"fits, but {conflict}; drop one of the two (or give the cap as a number)"
        )


def total_steps(steps_per_epoch: int, max_epochs: int | None, max_steps: int | None) -> int:
    """Optimizer steps the Trainer will take, by Lightning's own rule: an unset max_epochs is 1000 without
    max_steps, and none with it; max_epochs=-1 means no limit, which leaves only max_steps."""
    max_steps = -1 if max_steps is None else int(max_steps)
    if max_epochs is None:
        max_epochs = 1000 if max_steps == -1 else None
    elif int(max_epochs) < 0:
        max_epochs = None
    by_epochs = steps_per_epoch * int(max_epochs) if max_epochs is not None else math.inf
    by_steps = max_steps if max_steps != -1 else math.inf
    steps = min(by_epochs, by_steps)
    if steps == math.inf:
        raise UserError(
            "trainer.max_epochs=-1 without trainer.max_steps trains without end, and the LR schedule (warmup, "
            "decay) needs one: set trainer.max_epochs or trainer.max_steps"
        )
    return int(steps)


def batch_limit(batches: int, limit: float | None) -> int:
    """Lightning's reading of a `limit_*_batches`-style value: an int (or a whole float above 1) caps the count,
    a float in [0, 1] is a share of it, rounded down."""
    if limit is None:
        return batches
    if isinstance(limit, float) and limit <= 1.0:
        return int(batches * limit)
    return min(batches, int(limit))


def epoch_steps(
    train_size: int | None, batch: BatchPlan, trainer: TrainerArgs
) -> tuple[int | None, str | None, int | float | None]:
    """Optimizer steps per epoch as Lightning takes them, and the debug flag that shortens the epoch with its value
    (None, None if none).

    A full epoch is the global batches the training set fills (the sampler skips the tail). Lightning's debug
    flags cut it short, counting each rank's loader batches (micro-batches): `limit_train_batches` and
    `fast_dev_run` keep a number or a share of them, `overfit_batches` likewise but of the sequential loader
    Lightning swaps in, which keeps the tail. An epoch that ends inside an accumulation still steps: rounded up.
    """
    if train_size is None:
        return None, None, None
    batches = train_size // batch.global_ * batch.accumulation
    fast_dev_run = int(trainer.fast_dev_run or 0)  # True is 1 batch
    if trainer.overfit_batches:
        flag = "overfit_batches"
        batches = math.ceil(math.ceil(train_size / batch.world_size) / batch.per_device)
    else:
        flag = "fast_dev_run" if fast_dev_run else "limit_train_batches"
    limit = fast_dev_run if flag == "fast_dev_run" else getattr(trainer, flag)
    limited = batch_limit(batches, limit)
    if limited == 0 and limit:
        raise UserError(f"trainer.{flag}={limit} keeps less than one of the {batches} batches per epoch; raise it")
    shortened = limited != batches or flag == "overfit_batches"
    steps = math.ceil(limited / batch.accumulation)
    return (steps, flag, limit) if shortened else (steps, None, None)


def run_steps(steps_per_epoch: int | None, trainer: TrainerArgs) -> int | None:
    """Optimizer steps of the whole run; `fast_dev_run=n` makes Lightning run one epoch of at most n steps."""
    if steps_per_epoch is None:
        return None
    fast_dev_run = int(trainer.fast_dev_run or 0)
    if fast_dev_run:
        return total_steps(steps_per_epoch, 1, fast_dev_run)
    return total_steps(steps_per_epoch, trainer.max_epochs, trainer.max_steps)
