"""Exact metrics on any number of processes: per-process states, reduced once by torchmetrics at `compute()`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import lightning as L
import torch
from torch import nn
from torchmetrics import MeanMetric, Metric, MetricCollection, SumMetric

STAGES = ("train", "val", "test")
RESERVED = ("loss", "samples")


class StageMetrics(nn.Module):
    """Any torchmetrics Metric or MetricCollection, one copy per stage, plus `<stage>/loss` and `<stage>/samples`.

    In a LightningModule::

        self.metrics = StageMetrics({"acc": MulticlassAccuracy(num_classes, average="micro")})
        ...
        def validation_step(self, batch, batch_idx):
            x, y = batch
            logits = self(x)
            loss = F.cross_entropy(logits, y)
            self.metrics.update("val", logits, y, batch_size=len(y), loss=loss)
            self.metrics.log(self, "val")

    `update(stage, *args, **kwargs)` passes its arguments to the wrapped metrics' `update` (a MetricCollection
    hands each metric the keyword arguments its `update` takes); `batch_size` (samples in this device's batch) is
    added to `<stage>/samples`, and `loss`, a mean over the batch, to the sample-weighted `<stage>/loss`.
    `log(module, stage)` logs each metric object once per epoch as `<stage>/<name>`.

    Why it is exact: torchmetrics keeps per-process states (correct counts, loss sums, sample counts) and
    all-gathers them once, at epoch end, so the result counts every sample once however unevenly the samples fall
    over ranks, and evaluation runs no collective per step (uneven batch counts cannot hang). `self.log(value,
    sync_dist=True)` instead averages per-rank means, which mis-weights ranks with fewer samples. Choose metrics
    whose state is sums or counts (accuracy with `average="micro"`, means, perplexity), not per-batch averages.
    """

    def __init__(self, metrics: Metric | MetricCollection | Mapping[str, Metric] | None = None, stages=STAGES) -> None:
        super().__init__()
        collection = metrics if isinstance(metrics, MetricCollection) else MetricCollection(metrics or {})
        members = dict(collection.items(keep_base=False, copy_state=False))
        if clash := [name for name in RESERVED if name in members]:
            raise ValueError(f"StageMetrics adds {', '.join(RESERVED)} itself; rename your metric {clash[0]!r}")
        self.stages = tuple(stages)
        for stage in self.stages:
            # An attribute per stage, not a ModuleDict keyed by stage: "train" would shadow nn.Module.train.
            per_stage = {
                # compute_groups=False: each metric keeps its own states, so logging them one by one is safe.
                "task": MetricCollection({k: m.clone() for k, m in members.items()}, compute_groups=False),
                "loss": MeanMetric(),
                "samples": SumMetric(),
            }
            self.add_module(f"{stage}_metrics", nn.ModuleDict(per_stage))

    def _stage(self, stage: str) -> nn.ModuleDict:
        if stage not in self.stages:
            raise ValueError(f"unknown stage {stage!r}; StageMetrics has {', '.join(self.stages)}")
        return getattr(self, f"{stage}_metrics")

    def update(self, stage: str, *args: Any, batch_size: int, loss: torch.Tensor | None = None, **kwargs: Any) -> None:
        metrics = self._stage(stage)
        if len(metrics["task"]):
            metrics["task"].update(*args, **kwargs)
        metrics["samples"].update(float(batch_size))
        if loss is not None:
            metrics["loss"].update(loss.detach(), weight=batch_size)

    def items(self, stage: str) -> list[tuple[str, Metric]]:
        """(name, metric) pairs of one stage: the wrapped metrics, `loss` once updated, and `samples`."""
        metrics = self._stage(stage)
        task = list(metrics["task"].items(keep_base=False, copy_state=False))
        loss = [("loss", metrics["loss"])] if metrics["loss"].update_called else []
        return [*task, *loss, ("samples", metrics["samples"])]

    def log(self, module: L.LightningModule, stage: str, prog_bar: Iterable[str] = ()) -> None:
        """Log every metric of `stage` as `<stage>/<name>`: computed (and all-gathered) once per epoch."""
        prog_bar = set(prog_bar)
        for name, metric in self.items(stage):
            module.log(f"{stage}/{name}", metric, on_step=False, on_epoch=True, prog_bar=name in prog_bar)
