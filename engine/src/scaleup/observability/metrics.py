"""Exact metrics on any number of processes: per-process states, reduced once by torchmetrics at `compute()`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import move_data_to_device
from torch import nn
from torchmetrics import Metric, MetricCollection

__all__ = ["SampleMean", "SampleSum", "StageMetrics"]

STAGES = ("train", "val", "test")
RESERVED = ("loss", "samples")


class SampleSum(Metric):
    """A sum over every process, updated without reading anything back from the device.

    torchmetrics' SumMetric and MeanMetric check each update for NaN (`if isnan(x).any()`, a host read that waits
    for the GPU) and turn a Python number into a tensor with a blocking host-to-device copy; with NaN checks
    disabled, MeanMetric drops its weights. Here a NaN stays in the sum, where it shows, and a Python number is
    added as a scalar (no copy).
    """

    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, value: torch.Tensor | float) -> None:
        self.total.add_(value)

    def compute(self) -> torch.Tensor:
        return self.total


class SampleMean(SampleSum):
    """A per-sample mean from batch means: sum(mean x batch size) / sum(batch size), over every process."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("samples", default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, value: torch.Tensor, weight: float) -> None:
        self.total.add_(value, alpha=weight)
        self.samples.add_(weight)

    def compute(self) -> torch.Tensor:
        return self.total / self.samples


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
    `log(module, stage)` logs each metric object as `<stage>/<name>`, computed once per epoch. `eval_only` names
    metrics that validation and test compute but training does not: every metric updated in training costs its
    tensor ops in every step (top-5 accuracy, MulticlassAccuracy(top_k=5), is about 85 us an update on a CPU).

    Per step this costs only the metrics' own updates, however many metrics there are: `log` hands the metric
    objects to Lightning on the stage's first update after Lightning's epoch-end reset and does nothing on the other
    steps (each `LightningModule.log` call costs about 1.5 ms of Python, mostly moving the metric to the device);
    Lightning computes and resets the objects it holds at the epoch's end, so the value covers every step.
    No update reads a value back from the device, so the host never waits for a GPU step: `loss` and `samples`
    are StageMetrics' own sums, and the wrapped metrics should read nothing either (torchmetrics' MulticlassAccuracy
    does not on scores or logits; engine/tests/test_host_sync.py shows how to check one).

    Why it is exact: torchmetrics keeps per-process states (correct counts, loss sums, sample counts) and
    all-gathers them once, at epoch end, so the result counts every sample once however unevenly the samples fall
    over ranks, and evaluation runs no collective per step (uneven batch counts cannot hang). `self.log(value,
    sync_dist=True)` in an epoch-end hook instead averages each rank's one value, which mis-weights ranks with fewer
    samples. Choose metrics whose state is sums or counts (accuracy with `average="micro"`, means, perplexity), not
    per-batch averages.
    """

    def __init__(
        self,
        metrics: Metric | MetricCollection | Mapping[str, Metric] | None = None,
        stages: Iterable[str] = STAGES,
        eval_only: Iterable[str] = (),
    ) -> None:
        super().__init__()
        collection = metrics if isinstance(metrics, MetricCollection) else MetricCollection(metrics or {})
        members = dict(collection.items(keep_base=False, copy_state=False))
        if clash := [name for name in RESERVED if name in members]:
            raise ValueError(f"StageMetrics adds {', '.join(RESERVED)} itself; rename your metric {clash[0]!r}")
        eval_only = set(eval_only)
        if unknown := sorted(eval_only - set(members)):
            raise ValueError(f"eval_only names {unknown[0]!r}, which is not one of the metrics: {', '.join(members)}")
        self.stages = tuple(stages)
        for stage in self.stages:
            kept = {k: m for k, m in members.items() if stage != "train" or k not in eval_only}
            # An attribute per stage, not a ModuleDict keyed by stage: "train" would shadow nn.Module.train.
            per_stage = {
                # compute_groups=False: each metric keeps its own states, so logging them one by one is safe.
                "task": MetricCollection({k: m.clone() for k, m in kept.items()}, compute_groups=False),
                "loss": SampleMean(),
                "samples": SampleSum(),
            }
            self.add_module(f"{stage}_metrics", nn.ModuleDict(per_stage))
        # The same modules by stage name, in a plain dict: nn.Module's attribute and ModuleDict lookups are a few
        # Python calls each, and `update` and `log` run every step.
        self._by_stage = {
            stage: (group["task"], tuple(group["task"].values(copy_state=False)), group["loss"], group["samples"])
            for stage in self.stages
            for group in [getattr(self, f"{stage}_metrics")]
        }

    def _stage(self, stage: str) -> tuple[MetricCollection, tuple[Metric, ...], SampleMean, SampleSum]:
        """(the wrapped collection, its metrics, loss, samples) of `stage`."""
        metrics = self._by_stage.get(stage)
        if metrics is None:
            raise ValueError(f"unknown stage {stage!r}; StageMetrics has {', '.join(self.stages)}")
        return metrics

    def update(self, stage: str, *args: Any, batch_size: int, loss: torch.Tensor | None = None, **kwargs: Any) -> None:
        collection, task, loss_mean, samples = self._stage(stage)
        if kwargs:  # the collection hands each metric the keyword arguments its update takes
            collection.update(*args, **kwargs)
        else:  # the same calls, without the collection's per-metric filtering (about 10 us a step)
            for metric in task:
                metric.update(*args)
        samples.update(batch_size)
        if loss is not None:
            loss_mean.update(loss, weight=batch_size)

    def items(self, stage: str) -> list[tuple[str, Metric]]:
        """(name, metric) pairs of one stage: the wrapped metrics, `loss` once updated, and `samples`."""
        collection, _, loss_mean, samples = self._stage(stage)
        task = list(collection.items(keep_base=False, copy_state=False))
        loss = [("loss", loss_mean)] if loss_mean.update_called else []
        return [*task, *loss, ("samples", samples)]

    def epoch_states(self, stage: str) -> dict[str, dict[str, Any]]:
        """A copy of this process's running states of `stage`'s metrics (the wrapped ones, `loss`, `samples`), by
        metric and state name, where they are (no host read): what a mid-epoch checkpoint carries so that the
        epoch's values still cover every sample after a resume (torchmetrics keeps them out of the state_dict)."""
        return {
            name: {key: _copy(value) for key, value in metric.metric_state.items()} for name, metric in self._all(stage)
        }

    def restore_epoch_states(self, stage: str, saved: list[dict[str, dict[str, Any]]]) -> list[str]:
        """Continue `stage`'s epoch from `epoch_states` saved by one or more processes (this process's share, when
        the run resumes on fewer): the first set taken as it is, the others merged into it with each state's own
        reduction (torchmetrics' `merge_state`). Returns the names of the metrics that cannot merge (a metric with
        `full_state_update`): they keep the first set alone."""
        unmerged = []
        for name, metric in self._all(stage):
            states = [entry[name] for entry in saved if name in entry]
            if not states:
                continue
            for key, value in states[0].items():
                setattr(metric, key, move_data_to_device(value, metric.device))
            for other in states[1:]:
                try:
                    metric.merge_state(move_data_to_device(other, metric.device))
                except RuntimeError:
                    unmerged.append(name)
                    break
        return unmerged

    def _all(self, stage: str) -> list[tuple[str, Metric]]:
        """Every metric object of `stage`, `loss` included before its first update."""
        collection, _, loss_mean, samples = self._stage(stage)
        return [*collection.items(keep_base=False, copy_state=False), ("loss", loss_mean), ("samples", samples)]

    def log(self, module: L.LightningModule, stage: str, prog_bar: Iterable[str] = ()) -> None:
        """Log every metric of `stage` as `<stage>/<name>`: computed (and all-gathered) once per epoch.

        Call it every step, after `update`: only the first step of the stage's epoch hands the objects over."""
        *_, samples = self._stage(stage)
        if samples.update_count > 1:  # already with Lightning, which holds the objects
            return
        prog_bar = set(prog_bar)
        for name, metric in self.items(stage):
            module.log(f"{stage}/{name}", metric, on_step=False, on_epoch=True, prog_bar=name in prog_bar)


def _copy(value: torch.Tensor | list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
    """A metric state (a tensor, or a list of them) copied where it is."""
    if isinstance(value, list):
        return [item.detach().clone() for item in value]
    return value.detach().clone()
