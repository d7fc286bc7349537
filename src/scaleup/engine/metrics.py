"""Exact metrics on any number of processes: per-process sums and counts, reduced once by torchmetrics."""

from __future__ import annotations

import torch
from torch import nn
from torchmetrics import MeanMetric, Metric, SumMetric
from torchmetrics.classification import MulticlassAccuracy


class StageMetrics(nn.Module):
    """Sums and counts, reduced across processes once, at `compute()`.

    torchmetrics keeps per-process states (correct counts, loss sums, sample counts) and all-gathers them at
    epoch end, so the result is exact however unevenly the samples fall over ranks, and evaluation runs no
    collective per step (uneven batch counts cannot hang). `self.log(value, sync_dist=True)` instead averages
    per-rank means, which mis-weights ranks with fewer samples.
    """

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.metrics = nn.ModuleDict(
            {
                "acc": MulticlassAccuracy(num_classes, top_k=1, average="micro"),
                "loss": MeanMetric(),
                "samples": SumMetric(),
            }
        )
        if num_classes > 5:
            self.metrics["acc5"] = MulticlassAccuracy(num_classes, top_k=5, average="micro")

    def update(self, logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor) -> None:
        n = target.numel()
        for name, metric in self.metrics.items():
            if name == "loss":
                metric.update(loss.detach(), weight=n)
            elif name == "samples":
                metric.update(torch.tensor(float(n), device=target.device))
            else:
                metric.update(logits.detach(), target)

    def items(self) -> list[tuple[str, Metric]]:
        return list(self.metrics.items())
