"""Where multi-device time and memory go: data wait, throughput, peak memory per rank, optionally FLOPs and MFU."""

from __future__ import annotations

import logging
import math
import resource
import socket
import sys
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch.utilities.data import extract_batch_size
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.flop_counter import FlopCounterMode

from scaleup.observability.speedup import speedup_report
from scaleup.observability.step_time import (
    RankTimes,
    find_straggler,
    loader_workers,
    rank_metrics,
    straggler_line,
    summary_lines,
)

if TYPE_CHECKING:
    from scaleup.config.typed import TrainConfig

log = logging.getLogger(__name__)

UNEVEN_MEMORY = 1.2  # warn when the hungriest rank uses 20% more than the leanest
DATA_BOUND = 0.1  # a data wait above this share of the step time: the loaders hold training back
FOLD_EVERY = 16  # steps between two folds of the marks into the sums: less work per step, a short queue


def loader_workers_needed(
    wait: float, busy: float, samples: int, steps: int, workers: int
) -> tuple[float, float, bool]:
    """(samples/s one loader worker delivers, workers needed to feed the compute, whether that is an estimate
    rather than an upper bound), from one device's epoch: `wait` s waiting for batches between `steps` steps
    that took `busy` s to compute `samples`, with `workers` loader workers.

    With no workers the main process loads every batch but the first (whose wait is not counted) during the
    wait: it is the one worker, timed exactly.
    Workers that kept the device waiting were busy all the time, so each delivered the throughput over their
    number. Workers that kept up (the wait under DATA_BOUND) were partly idle: their throughput is a lower bound
    of their rate, and as many as there are suffice. Below 2 steps nothing is measured: (0, 0, False).
    """
    if steps < 2 or wait <= 0:
        return 0.0, 0.0, False
    compute_rate = samples / max(busy, 1e-9)
    if workers == 0:
        per_worker, exact = samples * (steps - 1) / steps / wait, True
    else:
        per_worker, exact = samples / (wait + busy) / workers, wait / (wait + busy) > DATA_BOUND
    needed = compute_rate / per_worker
    return per_worker, needed if exact else min(needed, workers), exact


def batch_size(batch: Any) -> int:
    """Lightning's reading of a batch's size (the first tensor's length, in any structure), with the common
    (tensor, ...) batch read directly: Lightning's walks every element, about 20 Python calls per step."""
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor) and batch[0].ndim:
        return batch[0].shape[0]
    return extract_batch_size(batch)


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
    (global), and `perf/peak_mem_gb` of every rank, warning when ranks differ; `perf/loader_samples_per_s_per_worker`
    and `perf/loader_workers_needed` (per device, `loader_workers_needed`), which the first epoch's end also states
    in one line. With `flops=True` also
    `perf/tflops_per_s` (global, model FLOPs: 3x the forward's) and `perf/mfu` (that over the devices' peak for
    the training precision, where Lightning knows the GPU). The forward is counted in the run's first training
    step, as the module consumes its batch (a tensor, a tuple, a dict, ...): torch's FlopCounterMode from the
    batch's start to the backward. No extra forward pass, so no BatchNorm statistic, random stream or metric of
    the run changes; that step, slowed down by the counting, is left out of the timings.

    With DDP the slowest rank sets everyone's pace: a high data wait means the loaders cannot keep up (raise
    `data.num_workers`), and uneven memory means something runs on one rank only. Per rank it also logs where a
    training batch's time goes (scaleup.observability.step_time): `perf/rank<r>/compute_s`, `data_wait_s` and
    `comm_s`, the last the exposed communication of DDP's gradient reduction: from the end of the rank's own
    backward (the last gradient bucket ready, marked by a comm hook that then runs DDP's own allreduce) to the
    reduction's completion (after the backward, when DDP has waited for it). It names a straggler (a rank whose
    compute is well above the others') in a warning with its host. Per step it costs two CUDA events (or two host
    clock reads on CPU), two more in a step that reduces gradients, and no synchronisation; the ranks exchange their
    numbers once per epoch (and their host names once per run).
    """

    def __init__(self, flops: bool = False) -> None:
        self.flops = flops
        self._flops_per_sample: float | None = None
        self._counter: FlopCounterMode | None = None  # open from the counted step's start to its backward
        self._counted_samples = 0  # the batch size of the step whose forward is counted, until that step ends
        self._clock: StreamClock | None = None
        self._marks: deque = deque()  # start, end, start, end, ... not yet folded into the sums
        self._comm_marks: deque = deque()  # compute end, reduced, ... (exposed communication) not yet folded
        self._last_end: Any = None
        self._wait = self._busy = self._comm = 0.0
        self._samples = self._steps = 0
        self._timing = False  # inside a timed step
        self._compute_end: Any = None  # the mark of this backward's last gradient bucket, until the backward ends
        self._comm_measured = True  # False where no hook times the reduction (FSDP, a comm hook of the user's)
        self._hooked: torch.nn.Module | None = None
        self._hosts: list[str] = []
        self._named: set[int] = set()  # the stragglers warned about, once each per run
        self._reported = False  # the loader line, once per run

    def dry_run_report(self, config: TrainConfig, plan: dict[str, Any], given: dict[str, Any]) -> list[tuple[int, str]]:
        """What a dry run prints after its plan (`given`: its config as composed): with `diagnostics_from=<run dir>`,
        the estimate of this plan's step time from that run's measured figures (observability/speedup.py)."""
        source = config.diagnostics_from
        return [] if source is None else speedup_report(source, plan, given)

    def closing_lines(self, trainer: L.Trainer, metrics: dict[str, Any]) -> list[str]:
        """The run's last lines, from its metrics.json: where its step time went, and what to do about it
        (observability/step_time.py)."""
        datamodule = trainer.datamodule
        return summary_lines(
            metrics,
            workers=loader_workers(datamodule),
            in_memory=getattr(datamodule, "in_memory", False),
            devices_per_node=trainer.num_devices,
            manual_optimization=not trainer.lightning_module.automatic_optimization,
        )

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._hosts = host_names(trainer.world_size)
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            self._comm_measured = trainer.world_size == 1  # one process: nothing to exchange; FSDP: not measured
            return
        if model is not self._hooked:
            try:
                model.register_comm_hook(None, self._reduce)
                self._hooked = model
            except RuntimeError:  # DDP takes one hook: the user registered their own
                self._comm_measured = False
                log.info("the gradient reduction has a comm hook of its own: its communication time is not measured")

    def _reduce(self, process_group, bucket):  # no hints: DDP checks them, and this module's are postponed strings
        """DDP's gradient reduction, as it runs without a hook (torch's allreduce_hook: divide by the world size,
        sum), with the time its last bucket became ready: this rank's backward is done from there on. It runs where
        the backward runs (the autograd thread, in its stream), so on a GPU the event marks the last gradient's
        kernel in the stream order. A dist.GradBucket in, a torch.futures.Future of the reduced bucket out."""
        if bucket.is_last() and self._clock is not None:
            self._compute_end = self._clock.mark()
        return allreduce_hook(process_group, bucket)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A run resumed in the middle of an epoch gets no on_train_epoch_start from Lightning for that epoch.
        self.on_train_epoch_start(trainer, pl_module)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._clock = StreamClock(pl_module.device)
        self._marks.clear()
        self._comm_marks.clear()
        self._timing, self._compute_end = False, None
        self._last_end, self._wait, self._busy, self._comm, self._samples, self._steps = None, 0.0, 0.0, 0.0, 0, 0
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)  # this epoch's peak, not the run's

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.flops and self._flops_per_sample is None and not self._counted_samples:
            self._counter, self._counted_samples = FlopCounterMode(display=False), batch_size(batch)
            self._counter.__enter__()
            return  # counting slows this step down: it is left out of the timings
        self._marks.append(self._clock.mark())  # the batch is on the device: fetch and copy are behind us
        self._timing = True
        if len(self._marks) > 2 * FOLD_EVERY:
            self._fold(wait_for_all=False)

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self._stop_counting()

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # DDP waited for the reduction before the backward returned (on a GPU: the stream waits for it), so this
        # mark is its completion. A backward without a reduction (accumulating under no_sync) left no mark.
        if self._compute_end is None:
            return
        if self._timing:
            self._comm_marks.extend((self._compute_end, self._clock.mark()))
        self._compute_end = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop_counting()  # the counter is a mode on this thread: never left on after the run

    def _stop_counting(self) -> None:
        """Training FLOPs per sample from the forward counted in this step: 3x, the backward costing about twice the
        forward. (A step without a backward, whose training_step returned None, ends the count at its end.)"""
        if self._counter is None:
            return
        counter, self._counter = self._counter, None
        counter.__exit__(None, None, None)
        self._flops_per_sample = 3 * counter.get_total_flops() / max(self._counted_samples, 1)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._counted_samples:
            self._stop_counting()
            self._counted_samples = 0
            return
        self._marks.append(self._clock.mark())
        self._timing = False
        self._samples += batch_size(batch)
        self._steps += 1

    def _fold(self, wait_for_all: bool) -> None:
        """Add the finished steps to the sums, keeping the queue as short as the host's lead over the GPU."""
        while len(self._marks) >= 2 and (wait_for_all or self._clock.ready(self._marks[1])):
            start, end = self._marks.popleft(), self._marks.popleft()
            if self._last_end is not None:
                self._wait += self._clock.seconds(self._last_end, start)  # loader, collate, host-to-device copy
            self._busy += self._clock.seconds(start, end)
            self._last_end = end
        while len(self._comm_marks) >= 2 and (wait_for_all or self._clock.ready(self._comm_marks[1])):
            compute_end, reduced = self._comm_marks.popleft(), self._comm_marks.popleft()
            self._comm += self._clock.seconds(compute_end, reduced)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._clock is not None and self._clock.cuda:
            torch.cuda.synchronize(pl_module.device)  # once per epoch: the last steps' events complete
        if len(self._marks) % 2:  # a step that started but did not end (interrupted): not counted
            self._marks.pop()
            self._timing = False
        self._fold(wait_for_all=True)
        total = self._wait + self._busy
        if total == 0:
            return
        workers = getattr(trainer.train_dataloader, "num_workers", 0)
        per_worker, needed, exact = loader_workers_needed(self._wait, self._busy, self._samples, self._steps, workers)
        # One small all_gather at epoch end, which every rank reaches: the per-rank numbers, side by side.
        memory = peak_memory_gb(pl_module.device)
        steps = max(self._steps, 1)
        comm = self._comm / steps if self._comm_measured else -1.0
        compute = (self._busy - self._comm) / steps
        mine = [
            self._wait / total,
            self._samples / total,
            memory,
            per_worker,
            needed,
            self._wait / steps,
            compute,
            comm,
        ]
        mine = torch.tensor(mine)
        ranks = trainer.strategy.all_gather(mine.to(pl_module.device)).reshape(-1, len(mine)).cpu()
        times = [RankTimes(wait, compute, comm if comm >= 0 else None) for wait, compute, comm in ranks[:, 5:].tolist()]
        metrics = {
            "perf/data_wait": ranks[:, 0].max().item(),  # the slowest rank holds up the others
            "perf/samples_per_s": ranks[:, 1].sum().item(),
            "perf/peak_mem_gb": ranks[:, 2].max().item(),
            "perf/loader_samples_per_s_per_worker": ranks[:, 3].min().item(),
            "perf/loader_workers_needed": ranks[:, 4].max().item(),  # per device, for the hungriest rank
        }
        if trainer.is_global_zero and not self._reported and per_worker > 0:
            in_memory = getattr(trainer.datamodule, "in_memory", False)
            self._report_workers(metrics, workers, exact, in_memory, loader_workers(trainer.datamodule).setting)
            self._reported = True
        if self._flops_per_sample:
            achieved = self._flops_per_sample * metrics["perf/samples_per_s"]
            metrics["perf/tflops_per_s"] = achieved / 1e12
            peak = get_available_flops(pl_module.device, compute_dtype(trainer.precision))
            if peak:
                metrics["perf/mfu"] = achieved / (peak * trainer.world_size)
        metrics |= rank_metrics(times)
        # Identical on every rank after the gather: logged as they are, with no collective per name (rank_zero_only
        # turns Lightning's reduction off; every rank still logs them).
        pl_module.log_dict(metrics, sync_dist=True, rank_zero_only=True)
        if trainer.is_global_zero:
            self._warn_straggler(times)
        memory = ranks[:, 2]
        if trainer.is_global_zero and memory.min() > 0 and memory.max() / memory.min() > UNEVEN_MEMORY:
            log.warning(
                "peak memory differs across ranks: "
                + ", ".join(f"rank {r} {m:.2f} GB" for r, m in enumerate(memory.tolist()))
                + ". DDP keeps identical replicas, so look for work done on one rank only (tensors kept for "
                "logging, evaluation or saving on rank 0)"
            )

    def _warn_straggler(self, ranks: list[RankTimes]) -> None:
        """The straggler in a warning, with its host, the first epoch each rank is one."""
        straggler = find_straggler(ranks)
        if straggler is None or straggler.rank in self._named:
            return
        self._named.add(straggler.rank)
        host = self._hosts[straggler.rank] if straggler.rank < len(self._hosts) else "?"
        log.warning(straggler_line(straggler, f"host {host}"))

    def _report_workers(
        self, metrics: dict[str, float], workers: int, exact: bool, in_memory: bool, setting: str
    ) -> None:
        """One line, after the run's first epoch: the step's compute, one worker's rate, the workers that rate
        needs, and their `setting` (step_time.loader_workers); a warning when the loaders hold training back and more
        workers would not.

        Never a warning for a data module that holds its data in memory (`in_memory = True`: loader workers would
        only add start-up time): its batches are cheap to make, and much of the wait between two small steps is
        the training loop's own work between batches (hooks, logging), which workers do not shorten (digits on a
        CPU: "data wait 30%" with the main process delivering 120,000 samples/s)."""
        steps, needed = max(self._steps, 1), max(1, math.ceil(metrics["perf/loader_workers_needed"]))
        # A rank that waits for a straggler in the gradient reduction does not compute meanwhile: said apart.
        waits = f" and waits {1000 * self._comm / steps:.1f} ms in the gradient all-reduce" if self._comm else ""
        line = (
            f"loaders: a step computes {self._samples / steps:.0f} samples per device in "
            f"{1000 * (self._busy - self._comm) / steps:.1f} ms{waits}; one loader worker delivers "
            f"{'' if exact else 'at least '}{metrics['perf/loader_samples_per_s_per_worker']:.0f} samples/s "
            f"({setting.format(workers)}, data wait {metrics['perf/data_wait']:.0%}): keeping up needs "
            f"{'about' if exact else 'at most'} {needed} worker{'s' if needed > 1 else ''} per device, "
            "each on a CPU core of its own"
        )
        short = exact and metrics["perf/data_wait"] > DATA_BOUND and needed > workers and not in_memory
        (log.warning if short else log.info)(line)


def host_names(world_size: int) -> list[str]:
    """Every rank's host name, exchanged once (at the start of fit), for the straggler's warning."""
    if world_size == 1 or not dist.is_available() or not dist.is_initialized():
        return [socket.gethostname()]
    hosts: list[Any] = [None] * world_size
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the matmuls run in for a Lightning precision string (float32 means TF32 when that is on)."""
    for prefix, dtype in (("bf16", torch.bfloat16), ("16", torch.float16), ("64", torch.float64)):
        if str(precision).startswith(prefix):
            return dtype
    return torch.float32
