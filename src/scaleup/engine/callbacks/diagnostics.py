"""Where multi-device time and memory go: data wait, throughput, peak memory per rank, optionally FLOPs and MFU."""

from __future__ import annotations

import logging
import resource
import sys
import time
from collections import deque
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.throughput import get_available_flops, measure_flops
from lightning.pytorch.utilities.data import extract_batch_size

log = logging.getLogger(__name__)

UNEVEN_MEMORY = 1.2  # warn when the hungriest rank uses 20% more than the leanest


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated GPU memory since the last reset (every epoch), or on CPU the process's peak resident
    memory since it started: Linux cannot reset that, and it includes Python, the libraries and the data."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20  # bytes on macOS, KiB on Linux


class StreamClock:
    """Time points in the order the device runs the work.

    On CPU the host clock is that order. On a GPU the host only queues kernels and runs ahead, so host timers
    would measure launches; CUDA events recorded in the stream instead time the GPU itself: the gap between the
    end of one step and the start of the next is time the GPU sat idle waiting for the batch. Reading an event
    never blocks: `ready` says whether the GPU has reached it.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> float | torch.cuda.Event:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ready(self, mark: float | torch.cuda.Event) -> bool:
        return not self.cuda or mark.query()

    def seconds(self, start: float | torch.cuda.Event, end: float | torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1000 if self.cuda else end - start


class TrainingDiagnostics(L.Callback):
    """Logs per epoch: `perf/data_wait` (share of step time spent waiting for the next batch), `perf/samples_per_s`
    (global), and `perf/peak_mem_gb` of every rank, warning when ranks differ. With `flops=True` also
    `perf/tflops_per_s` (global, model FLOPs: 3x the forward's) and `perf/mfu` (that over the devices' peak for
    the training precision, where Lightning knows the GPU).

    With DDP the slowest rank sets everyone's pace: a high data wait means the loaders cannot keep up (raise
    `data.num_workers`), and uneven memory means something runs on one rank only. Per step it costs two CUDA
    events (or two host clock reads on CPU) and no synchronisation; the ranks exchange their numbers once per
    epoch.
    """

    def __init__(self, flops: bool = False) -> None:
        self.flops = flops
        self._flops_per_sample: float | None = None
        self._clock: StreamClock | None = None
        self._marks: deque = deque()  # start, end, start, end, ... not yet folded into the sums
        self._last_end: Any = None
        self._wait = self._busy = 0.0
        self._samples = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A run resumed in the middle of an epoch gets no on_train_epoch_start from Lightning for that epoch.
        self.on_train_epoch_start(trainer, pl_module)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._clock = StreamClock(pl_module.device)
        self._marks.clear()
        self._last_end, self._wait, self._busy, self._samples = None, 0.0, 0.0, 0
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)  # this epoch's peak, not the run's

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.flops and self._flops_per_sample is None:
            self._flops_per_sample = model_flops_per_sample(pl_module, batch)
        self._marks.append(self._clock.mark())  # the batch is on the device: fetch and copy are behind us
        self._fold(wait_for_all=False)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._marks.append(self._clock.mark())
        self._samples += extract_batch_size(batch)  # Lightning's reading: the first tensor's length, any structure

    def _fold(self, wait_for_all: bool) -> None:
        """Add the finished steps to the sums, keeping the queue as short as the host's lead over the GPU."""
        while len(self._marks) >= 2 and (wait_for_all or self._clock.ready(self._marks[1])):
            start, end = self._marks.popleft(), self._marks.popleft()
            if self._last_end is not None:
                self._wait += self._clock.seconds(self._last_end, start)  # loader, collate, host-to-device copy
            self._busy += self._clock.seconds(start, end)
            self._last_end = end

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._clock is not None and self._clock.cuda:
            torch.cuda.synchronize(pl_module.device)  # once per epoch: the last steps' events complete
        if len(self._marks) % 2:  # a step that started but did not end (interrupted): not counted
            self._marks.pop()
        self._fold(wait_for_all=True)
        total = self._wait + self._busy
        if total == 0:
            return
        # One small all_gather at epoch end, which every rank reaches: the per-rank numbers, side by side.
        mine = torch.tensor([self._wait / total, self._samples / total, peak_memory_gb(pl_module.device)])
        ranks = trainer.strategy.all_gather(mine.to(pl_module.device)).reshape(-1, 3).cpu()
        metrics = {
            "perf/data_wait": ranks[:, 0].max().item(),  # the slowest rank holds up the others
            "perf/samples_per_s": ranks[:, 1].sum().item(),
            "perf/peak_mem_gb": ranks[:, 2].max().item(),
        }
        if self._flops_per_sample:
            achieved = self._flops_per_sample * metrics["perf/samples_per_s"]
            metrics["perf/tflops_per_s"] = achieved / 1e12
            peak = get_available_flops(pl_module.device, compute_dtype(trainer.precision))
            if peak:
                metrics["perf/mfu"] = achieved / (peak * trainer.world_size)
        # Identical on every rank after the gather: the reduction changes nothing.
        pl_module.log_dict(metrics, sync_dist=True, reduce_fx="max")
        memory = ranks[:, 2]
        if trainer.is_global_zero and memory.min() > 0 and memory.max() / memory.min() > UNEVEN_MEMORY:
            log.warning(
                "peak memory differs across ranks: "
                + ", ".join(f"rank {r} {m:.2f} GB" for r, m in enumerate(memory.tolist()))
                + ". DDP keeps identical replicas, so look for work done on one rank only (tensors kept for "
                "logging, evaluation or saving on rank 0)"
            )


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the matmuls run in for a Lightning precision string (float32 means TF32 when that is on)."""
    for prefix, dtype in (("bf16", torch.bfloat16), ("16", torch.float16), ("64", torch.float64)):
        if str(precision).startswith(prefix):
            return dtype
    return torch.float32


@torch.no_grad()
def model_flops_per_sample(pl_module: L.LightningModule, batch: Any) -> float:
    """Training FLOPs per sample: one forward pass on the batch's inputs (its first element for a tuple or list,
    else the batch itself) counted by torch's FlopCounterMode, times 3 (the backward pass costs about twice the
    forward). Counted in eval mode without gradients, so no BatchNorm statistic, gradient or random stream of the
    run changes."""
    inputs = batch[0] if isinstance(batch, tuple | list) else batch
    was_training = pl_module.training
    pl_module.eval()
    try:
        forward = measure_flops(pl_module, lambda: pl_module(inputs))
    finally:
        pl_module.train(was_training)
    return 3 * forward / extract_batch_size(batch)
