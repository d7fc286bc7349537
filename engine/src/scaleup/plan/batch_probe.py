"""`data.max_per_device_batch_size=auto`: the largest per-device micro-batch that fits, found by trying it.

The global batch stays what the recipe says; only its split into micro-batches changes (accumulation =
global / (world size x micro-batch)). So the plan's steps, LR schedule and data order do not depend on the
outcome, and neither do the weights (up to float rounding): auto changes the speed, never the optimisation.

It runs in the Trainer's `on_fit_start`, the first moment at which
- every process exists (Lightning's launcher starts the other ranks inside `fit`), so the ranks can agree;
- the model sits on its device in its final precision, with DDP's gradient buckets allocated, so the probe
  measures what training will hold;
- the train loader, whose batch size follows from the accumulation, is not built yet, and Lightning reads
  `trainer.accumulate_grad_batches` afresh at every batch.
Before `fit` only rank 0 runs, and before `strategy.setup` the model is still on the CPU in float32.
"""

from __future__ import annotations

import json
import logging
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection, move_data_to_device
from torch.utils.data import default_collate
from torchmetrics import Metric

from scaleup.callbacks.run_files import RunFiles
from scaleup.errors import UserError
from scaleup.plan.checks import BATCH_NORMS, batchnorm_warning
from scaleup.plan.resolve import Plan

log = logging.getLogger(__name__)

# Share of the device's memory left free: allocator fragmentation, cuDNN workspaces that vary between steps, and
# the other processes' CUDA contexts. The optimizer state, allocated lazily at the first step, is counted apart.
AUTO_MARGIN = 0.10

# Lightning's warning when `self.log` is called on a module without a Trainer (and returns without logging).
LOG_WITHOUT_TRAINER = re.escape("You are trying to `self.log()` but the `self.trainer` reference is not registered")
# The end of Lightning's error when a module without a Trainer reads `self.trainer`.
NOT_ATTACHED = "is not attached to a `Trainer`."


def per_device_candidates(global_batch_size: int, world_size: int) -> list[int]:
    """Per-device batches that split the global batch exactly over `world_size` devices, largest first."""
    share = global_batch_size // world_size
    return [size for size in range(share, 0, -1) if share % size == 0]


def largest_that_fits(candidates: list[int], fits: Callable[[int], bool]) -> int:
    """The first candidate (largest first) that fits, or 0 when none does."""
    return next((size for size in candidates if fits(size)), 0)


def training_loss(module: L.LightningModule, batch: Any) -> torch.Tensor:
    """The module's own `training_step` on `batch`, with its logging off: any batch structure, any loss.

    The step runs with the module detached from its Trainer (the public `trainer` setter), where Lightning's own
    rule makes `self.log` and `self.log_dict` no-ops ("not an error to support testing the `*_step` methods without
    a `Trainer` reference"): they warn and return, and the warning is not shown. The Trainer is attached again
    after the step, also when it raises. Metric updates it makes are undone by the probe (every torchmetrics state
    is reset afterwards).
    """
    trainer = module.trainer
    module.trainer = None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=LOG_WITHOUT_TRAINER)
            output = module.training_step(batch, 0)
    except RuntimeError as error:
        if not str(error).endswith(NOT_ATTACHED):
            raise
        raise UserError(
            f"data.max_per_device_batch_size=auto runs {type(module).__name__}.training_step without its Trainer, "
            "so that it logs nothing, and the step reads self.trainer: give data.max_per_device_batch_size as a "
            "number"
        ) from None
    finally:
        module.trainer = trainer
    return output["loss"] if isinstance(output, Mapping) else output


def repeated(
    sample: Any, size: int, device: torch.device, convert: Callable[[Any], Any], data: L.LightningDataModule | None
) -> Any:
    """A batch of `size` copies of one sample, built on the device (no host copy of the whole batch), through the
    DataModule's own collate function and transfer hooks, as the training loop gives it to the model (uint8
    images become normalised floats in `on_after_batch_transfer`)."""
    if data is None:  # a Trainer fitted on bare loaders
        data = L.LightningDataModule()
    collate = getattr(data, "collate_fn", lambda split: None)("train") or default_collate
    one = data.on_before_batch_transfer(convert(collate([sample])), 0)
    one = data.on_after_batch_transfer(move_data_to_device(one, device), 0)
    return apply_to_collection(one, torch.Tensor, lambda t: t.expand(size, *t.shape[1:]).contiguous())


def optimizer_state_bytes(module: torch.nn.Module) -> int:
    """Room for the optimizer state, allocated at the first step: Adam's two moments per trainable weight
    (SGD with momentum needs one, so this errs on the safe side)."""
    return 2 * sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


@dataclass(frozen=True)
class SettledSplit:
    """What `auto` settled on at the start of `fit`, beside the plan made before it (which says `auto`): the run's
    batch_probe.json. Every checkpoint's stored plan holds the same split."""

    per_device_batch_size: int
    accumulate_grad_batches: int
    fits_on_rank_zero: int  # the largest split rank 0 found; the ranks take the smallest of theirs

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")


class AutoBatchSize(L.Callback):
    """Settles the per-device batch and the accumulation at the start of `fit`, the same on every rank.

    Each rank tries the exact splits of the global batch, largest first, with one forward and backward pass at
    the real input size (one training sample repeated, through the module's own `training_step`): a split fits
    when it runs without running out of memory and, on a GPU, its peak plus the optimizer state leaves `margin` of
    the device free. The ranks then take the smallest of their answers, so a rank with less free memory decides
    for all.

    The probe leaves no trace: BatchNorm layers run in eval mode (running statistics untouched, and no SyncBN
    collective, which would need every rank to probe in step), the random streams are restored, the gradients
    dropped and the metric states reset. `forward` is the forward half of the pass; tests wrap it to simulate a
    device with less memory.
    """

    def __init__(self, plan: Plan, record: str | Path | None = None, margin: float = AUTO_MARGIN) -> None:
        self.plan = plan
        self.record = Path(record) if record else None  # where SettledSplit is written (rank 0)
        self.margin = margin
        self.forward: Callable[[L.LightningModule, Any], torch.Tensor] = training_loss

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        sample = trainer.datamodule.splits["train"][0]
        candidates = per_device_candidates(self.plan.global_batch_size, trainer.world_size)
        mine = largest_that_fits(candidates, lambda size: self._fits(trainer, pl_module, sample, size))
        device = trainer.strategy.root_device
        agreed = int(trainer.strategy.all_gather(torch.tensor(mine, device=device)).min())
        if agreed == 0:
            raise UserError(
                f"data.max_per_device_batch_size=auto: not even one sample per device fits in {device}'s memory; "
                "use trainer.precision=bf16-mixed, a smaller model, or strategy=fsdp"
            )
        self.plan = self.plan.with_per_device_batch(agreed)
        # The loaders, built after this, and StepSeed follow the Trainer's accumulation.
        trainer.accumulate_grad_batches = self.plan.accumulate_grad_batches
        # Checkpoints record the split actually used: eval.py batches by it, a resume rescales its counters by it.
        for callback in trainer.callbacks:
            if isinstance(callback, RunFiles):
                callback.plan = self.plan.to_dict()
        if trainer.is_global_zero:
            self._report(mine, agreed)

    def _fits(self, trainer: L.Trainer, module: L.LightningModule, sample: Any, size: int) -> bool:
        device = trainer.strategy.root_device
        cuda = device.type == "cuda"
        norms = [m for m in module.modules() if isinstance(m, BATCH_NORMS) and m.training]
        for norm in norms:
            norm.eval()
        if cuda:
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info(device)
            budget = (free + torch.cuda.memory_reserved(device)) * (1 - self.margin) - optimizer_state_bytes(module)
            torch.cuda.reset_peak_memory_stats(device)
        try:
            batch = repeated(sample, size, device, trainer.precision_plugin.convert_input, trainer.datamodule)
            with torch.random.fork_rng(devices=[device] if cuda else []):
                with trainer.precision_plugin.forward_context():
                    loss = self.forward(module, batch)
                loss.backward()
            fitted = not cuda or torch.cuda.max_memory_allocated(device) <= budget
        except torch.OutOfMemoryError:
            fitted = False
        finally:
            for norm in norms:
                norm.train()
            module.zero_grad(set_to_none=True)
            for metric in module.modules():
                if isinstance(metric, Metric):
                    metric.reset()
        return fitted

    def _report(self, mine: int, agreed: int) -> None:
        plan = self.plan
        log.info(
            f"data.max_per_device_batch_size=auto: {mine} per device fits here, {agreed} on every device -> "
            f"per-device batch {agreed}, accumulation {plan.accumulate_grad_batches}, global batch "
            f"{plan.global_batch_size} (unchanged)"
        )
        warning = batchnorm_warning(plan)
        if warning:
            log.warning(warning)
        if self.record is not None:
            SettledSplit(plan.per_device_batch_size, plan.accumulate_grad_batches, mine).write(self.record)
