"""Where multi-device time and memory go: data wait, throughput, and peak memory per rank."""

from __future__ import annotations

import logging
import resource
import sys
import time
from typing import Any

import lightning as L
import torch

log = logging.getLogger(__name__)

UNEVEN_MEMORY = 1.2  # warn when the hungriest rank uses 20% more than the leanest


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated GPU memory, or the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20  # bytes on macOS, KiB on Linux


class TrainingDiagnostics(L.Callback):
    """Logs per epoch: `perf/data_wait` (share of step time spent waiting for the next batch), `perf/samples_per_s`
    (global), and `perf/peak_mem_gb` of every rank, warning when ranks differ.

    With DDP the slowest rank sets everyone's pace: a high data wait means the loaders cannot keep up (raise
    `data.num_workers`), and uneven memory means something runs on one rank only.
    """

    def __init__(self) -> None:
        self._batch_start = 0.0
        self._batch_end: float | None = None
        self._wait = self._busy = 0.0
        self._samples = 0

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._batch_end, self._wait, self._busy, self._samples = None, 0.0, 0.0, 0

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._batch_end is not None:
            self._wait += now - self._batch_end  # fetching this batch: loader, collate, host-to-device copy
        self._batch_start = now

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batch_end = time.perf_counter()
        self._busy += self._batch_end - self._batch_start
        self._samples += len(batch[0])

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        total = self._wait + self._busy
        if total == 0:
            return
        # One small all_gather at epoch end, which every rank reaches: the per-rank numbers, side by side.
        mine = torch.tensor([self._wait / total, self._samples / total, peak_memory_gb(pl_module.device)])
        ranks = trainer.strategy.all_gather(mine.to(pl_module.device)).reshape(-1, 3).cpu()
        pl_module.log_dict(
            {
                "perf/data_wait": ranks[:, 0].max().item(),  # the slowest rank holds up the others
                "perf/samples_per_s": ranks[:, 1].sum().item(),
                "perf/peak_mem_gb": ranks[:, 2].max().item(),
            },
            sync_dist=True,  # identical on every rank after the gather: the reduction changes nothing
            reduce_fx="max",
        )
        memory = ranks[:, 2]
        if trainer.is_global_zero and memory.min() > 0 and memory.max() / memory.min() > UNEVEN_MEMORY:
            log.warning(
                "peak memory differs across ranks: "
                + ", ".join(f"rank {r} {m:.2f} GB" for r, m in enumerate(memory.tolist()))
                + ". DDP keeps identical replicas, so look for work done on one rank only (tensors kept for "
                "logging, evaluation or saving on rank 0)"
            )
