"""What `configure_optimizers` returned, parsed by Lightning's own (private) code before any Trainer exists."""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer


def parse_configure_optimizers(returned: Any) -> tuple[list[Optimizer], list[Any]]:
    """(optimizers, LR schedulers) from anything `configure_optimizers` may return, parsed by Lightning's own code.

    Lightning 2.6.6. Reason: Lightning has no public parser of the return formats it accepts, and the plan reads
    the LRs before any Trainer exists; this calls the private `lightning.pytorch.core.optimizer._configure_optimizers`
    and, where that is gone, parses the documented formats itself (an optimizer, a list of them, a dict with
    "optimizer" and "lr_scheduler", a list of such dicts, or (optimizers, schedulers)).
    Canary: test_private_configure_optimizers_parses_every_return_format.
    """
    try:
        from lightning.pytorch.core.optimizer import _configure_optimizers

        optimizers, schedulers, _ = _configure_optimizers(returned)
    except ImportError:
        return documented_formats(returned)
    return optimizers, schedulers


def documented_formats(returned: Any) -> tuple[list[Optimizer], list[Any]]:
    """The return formats of `configure_optimizers` that Lightning's documentation lists."""
    if isinstance(returned, Optimizer):
        return [returned], []
    if isinstance(returned, dict):
        return [returned["optimizer"]], [returned["lr_scheduler"]] if "lr_scheduler" in returned else []
    if isinstance(returned, tuple) and len(returned) == 2 and all(isinstance(part, list) for part in returned):
        return list(returned[0]), list(returned[1])
    parsed = [documented_formats(item) for item in returned]
    return [o for optimizers, _ in parsed for o in optimizers], [s for _, schedulers in parsed for s in schedulers]
