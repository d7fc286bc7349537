"""A training loss that turns NaN or inf stops the run in one line naming the step, before another checkpoint is
written (`stop_on_nonfinite_loss`, on by default; JobControl's hooks drive it).

Reading the loss back at every step would make the host wait for the device at every step. Instead the losses are
kept on their device (no kernel, no read per micro-batch) and read where the loop waits for the device anyway, or
where it must: at logging steps (Lightning reads the logged values there), at an epoch's end, and
before every checkpoint is written, so that no checkpoint of weights trained on a NaN loss is written once the run
is known to be bad.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from scaleup.errors import UserError

NEVER = 2**62  # the first bad step while every loss was finite


def training_loss(outputs: Any) -> torch.Tensor | None:
    """The loss in what `training_step` returned as Lightning hands it to `on_train_batch_end`: a tensor, or a dict's
    `loss` (automatic optimization); None where there is none (a skipped step, manual optimization without one)."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    return loss if isinstance(loss, torch.Tensor) else None


class FirstNonFiniteLoss:
    """The first optimizer step whose training loss was NaN or inf since the last look (`first`).

    Each micro-batch's loss is kept as it is (a list append: no kernel, no read); every FOLD of them are reduced on
    their device to the position of the first bad one (a few kernels, no read), so that what is kept stays small
    however rarely the run looks. The steps stay on the host, one number per micro-batch since the last look.
    """

    FOLD = 256

    def __init__(self) -> None:
        self.step = 0  # the optimizer step the current micro-batch belongs to (the global step at its start)
        self._steps: list[int] = []  # per micro-batch since the last look
        self._losses: list[torch.Tensor] = []  # the ones not folded yet: the last of `_steps`
        self._first: torch.Tensor | None = None  # on the device: the position in `_steps` of the first bad loss

    def record(self, outputs: Any) -> None:
        """Keep this micro-batch's loss: nothing read back."""
        loss = training_loss(outputs)
        if loss is None:
            return
        if loss.requires_grad:  # a loss of manual optimization, holding its graph (Lightning's own are detached)
            loss = loss.detach()
        self._losses.append(loss if loss.ndim == 0 else loss.sum())  # a NaN or inf anywhere makes the sum one
        self._steps.append(self.step)
        if len(self._losses) == self.FOLD:
            self._fold()

    def _fold(self) -> None:
        if not self._losses:
            return
        losses = torch.stack(self._losses)
        end = len(self._steps)
        positions = torch.arange(end - len(losses), end, device=losses.device)
        first = torch.where(torch.isfinite(losses), NEVER, positions).min()
        self._first = first if self._first is None else torch.minimum(self._first, first)
        self._losses = []

    def first(self, group: Any = None, distributed: bool = False) -> int | None:
        """The first bad step of any rank since the last look, or None: reads the device (a sync), and with
        `distributed` takes the minimum over the ranks in `group` (a CPU group): every rank gets the same answer."""
        self._fold()
        position = NEVER if self._first is None else int(self._first)
        local = NEVER if position == NEVER else self._steps[position]
        if position == NEVER:
            self._steps, self._first = [], None  # all finite: nothing before this point is needed again
        if distributed:
            agreed = torch.tensor([local])
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
            local = int(agreed)
        return None if local == NEVER else local


def nonfinite_loss_error(step: int) -> UserError:
    """The one line that stops a run whose loss turned NaN or inf at optimizer step `step`."""
    return UserError(
        f"the training loss is NaN or inf at step {step}: the run stops, with no checkpoint written after that step "
        "(ckpt_path=last resumes from the one before); lower model.optimizer.lr, set trainer.gradient_clip_val, or "
        "look at that step's data; stop_on_nonfinite_loss=false trains on regardless",
        every_rank=True,  # the ranks agree on the first bad step
    )
