"""Top-k accuracy as two counts, updated without a host read: GPU steps never wait for it."""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics import Metric


class TopKAccuracy(Metric):
    """The share of samples whose target is among the `top_k` highest scores: correct and total counts, summed
    over every process at `compute()`, so exact on any number of devices (what torchmetrics' MulticlassAccuracy
    with `average="micro"` computes).

    MulticlassAccuracy counts with `torch.bincount`, which reads the largest class id back to the host on a GPU and
    so waits for the step's kernels on every update; this compares the top-k indices with the target instead.
    `preds` are scores of shape (N, C) (logits or probabilities), `target` class ids of shape (N,).
    """

    full_state_update = False
    higher_is_better = True

    def __init__(self, top_k: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.top_k = top_k
        self.add_state("correct", default=torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        if self.top_k == 1:
            hits = preds.argmax(dim=-1) == target
        else:
            hits = (preds.topk(self.top_k, dim=-1).indices == target.unsqueeze(-1)).any(dim=-1)
        self.correct += hits.sum()
        self.total += target.numel()  # a Python number is a kernel argument: no copy

    def compute(self) -> torch.Tensor:
        return self.correct.float() / self.total
