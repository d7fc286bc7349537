"""Where a training batch's time goes on each rank (compute, data wait, exposed communication), the straggler that
sets the job's pace, and the write-ups' advice, from the per-rank figures TrainingDiagnostics logs every epoch.

The figures are seconds per training batch (one `training_step`: a micro-batch under accumulation), per rank:
`perf/rank<r>/compute_s`, `perf/rank<r>/data_wait_s` and, where it is measured, `perf/rank<r>/comm_s`. They add up
to the rank's time per batch. The same functions read them back from a run's metrics.json (the run's summary, the
dry run's speedup estimate).
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from typing import Any

from scaleup.config.schema import accepted_arguments
from scaleup.data.adopted import AdoptedDataModule

STRAGGLER = 1.5  # a rank whose compute per batch is 1.5x the others' median holds the whole job back
DATA_BOUND = 0.2  # the write-ups: loading above ~20% of the step, fix the pipeline before adding devices
COMM_BOUND = 0.1  # the write-ups: communication above ~10% (one says 30%) of the step, scaling is far from linear
RANK_METRIC = re.compile(r"^perf/rank(\d+)/(compute_s|data_wait_s|comm_s)$")


@dataclass(frozen=True)
class RankTimes:
    """One rank's seconds per training batch: waiting for the batch, computing it (forward, backward, optimizer,
    the hooks), and waiting in the gradient reduction after its own backward was done (None: not measured)."""

    data_wait: float
    compute: float
    comm: float | None

    @property
    def step(self) -> float:
        return self.data_wait + self.compute + (self.comm or 0.0)


@dataclass(frozen=True)
class Straggler:
    """A rank well behind the others: its compute per batch against the median of the others', and the median
    share of the others' step they spend waiting for it."""

    rank: int
    compute: float
    others: float
    ratio: float
    others_waiting: float


@dataclass(frozen=True)
class LoaderWorkers:
    """The training loader's workers per device, as a run has them, and where its user sets them: `setting`, with
    `{}` for the number."""

    count: int
    setting: str = "data.num_workers={}"


def loader_workers(datamodule: Any) -> LoaderWorkers:
    """The training loader's workers and their setting: `data.num_workers` for the template's data modules and for an
    adopted LightningDataModule whose constructor takes `num_workers`; for one that does not, the DataLoader its own
    train_dataloader() returns, whose workers the template takes (data/adopted.py)."""
    if not isinstance(datamodule, AdoptedDataModule):
        return LoaderWorkers(getattr(datamodule, "num_workers", 0))
    module = type(datamodule.module)
    loader = datamodule.loaders.get("train")
    count = loader.num_workers if loader is not None else 0
    if "num_workers" in (accepted_arguments(f"{module.__module__}.{module.__qualname__}") or ()):
        return LoaderWorkers(count)
    return LoaderWorkers(count, f"num_workers={{}} in the DataLoader {module.__name__}.train_dataloader() returns")


def rank_metrics(ranks: list[RankTimes]) -> dict[str, float]:
    """The per-rank scalars and the job's: `perf/comm_share` (the pace-setting rank's, see `pace_setter`) and
    `perf/straggler_ratio` (see `straggler_ratio`), where communication is measured."""
    metrics = {}
    for rank, times in enumerate(ranks):
        metrics[f"perf/rank{rank}/compute_s"] = times.compute
        metrics[f"perf/rank{rank}/data_wait_s"] = times.data_wait
        if times.comm is not None:
            metrics[f"perf/rank{rank}/comm_s"] = times.comm
    if all(times.comm is not None for times in ranks):
        pace = ranks[pace_setter(ranks)]
        metrics["perf/comm_share"] = pace.comm / pace.step if pace.step else 0.0
        metrics["perf/straggler_ratio"] = straggler_ratio(ranks)
    return metrics


def ranks_from_metrics(metrics: dict[str, object]) -> list[RankTimes]:
    """The per-rank figures of a run's metrics.json (empty for a run without them)."""
    found: dict[int, dict[str, float]] = {}
    for name, value in metrics.items():
        if (match := RANK_METRIC.match(name)) and isinstance(value, (int, float)):
            found.setdefault(int(match[1]), {})[match[2]] = float(value)
    if sorted(found) != list(range(len(found))) or any("compute_s" not in f for f in found.values()):
        return []
    return [RankTimes(f.get("data_wait_s", 0.0), f["compute_s"], f.get("comm_s")) for _, f in sorted(found.items())]


def pace_setter(ranks: list[RankTimes]) -> int:
    """The rank the others wait for: the one that reaches the gradient reduction last, having spent the most time
    loading and computing its batch. Its own wait there is the communication alone (no peer to wait for), so its
    breakdown is the job's: its step is everyone's."""
    return max(range(len(ranks)), key=lambda r: ranks[r].data_wait + ranks[r].compute)


def straggler_ratio(ranks: list[RankTimes]) -> float:
    """The slowest rank's compute per batch over the median of the others' (1 on one process)."""
    if len(ranks) < 2:
        return 1.0
    slowest = max(range(len(ranks)), key=lambda r: ranks[r].compute)
    others = statistics.median(t.compute for r, t in enumerate(ranks) if r != slowest)
    return ranks[slowest].compute / others if others > 0 else math.inf


def find_straggler(ranks: list[RankTimes]) -> Straggler | None:
    """The slowest rank, if its compute per batch is more than STRAGGLER times the median of the others' and the
    communication is measured (the others' wait for it is their communication time beyond the straggler's own)."""
    if len(ranks) < 2 or any(t.comm is None for t in ranks) or straggler_ratio(ranks) <= STRAGGLER:
        return None
    slowest = max(range(len(ranks)), key=lambda r: ranks[r].compute)
    others = [t for r, t in enumerate(ranks) if r != slowest]
    waiting = statistics.median(max(0.0, t.comm - ranks[slowest].comm) / t.step for t in others if t.step)
    median = statistics.median(t.compute for t in others)
    return Straggler(slowest, ranks[slowest].compute, median, ranks[slowest].compute / median, waiting)


def straggler_line(straggler: Straggler, where: str) -> str:
    """The straggler in words: the rank and `where` it runs, its numbers, what to look at."""
    return (
        f"rank {straggler.rank} ({where}) is a straggler: it computes a training batch in "
        f"{1000 * straggler.compute:.1f} ms, {straggler.ratio:.1f}x the other ranks' median "
        f"({1000 * straggler.others:.1f} ms), and the others spend {straggler.others_waiting:.0%} of their step "
        "waiting for it in the gradient all-reduce. Every rank runs at the slowest one's pace: look at that rank's "
        "device (a slower or throttled GPU, another job on it) or at what only it does"
    )


def breakdown_line(ranks: list[RankTimes]) -> str:
    """The job's step split into compute, data wait and communication, as shares of the pace-setting rank's step."""
    pace = pace_setter(ranks)
    times = ranks[pace]
    step = times.step or 1e-12
    who = f"rank {pace}, which the others wait for" if len(ranks) > 1 else "1 process"
    if times.comm is None:
        comm = "communication not measured (counted in compute: docs/performance.md)"
    elif len(ranks) == 1:
        comm = "communication 0% (nothing to exchange)"
    else:
        comm = f"communication {times.comm / step:.0%}"
    return (
        f"step time: {1000 * times.step:.1f} ms per training batch ({who}): compute {times.compute / step:.0%}, "
        f"data wait {times.data_wait / step:.0%}, {comm}"
    )


def summary_lines(
    metrics: dict[str, object],
    *,
    workers: LoaderWorkers,
    in_memory: bool,
    devices_per_node: int,
    manual_optimization: bool = False,
) -> list[str]:
    """The run summary's last lines, from its metrics.json: the step-time breakdown, then one line of advice for
    each of data-bound, communication-bound and a straggler where it applies (none for a run without the per-rank
    figures). Only what applies is advised: the workers where `workers` says they are set, and no gradient
    accumulation for a module with `manual_optimization` (Lightning refuses it there)."""
    ranks = ranks_from_metrics(metrics)
    if not ranks:
        return []
    lines = [breakdown_line(ranks)]
    pace = ranks[pace_setter(ranks)]
    step = pace.step or 1e-12
    needed = metrics.get("perf/loader_workers_needed")
    if pace.data_wait / step > DATA_BOUND and not in_memory and isinstance(needed, (int, float)):
        wanted = max(workers.count + 1, math.ceil(needed))
        lines.append(
            f"data-bound: {pace.data_wait / step:.0%} of the step waits for batches (above ~{DATA_BOUND:.0%}, fix the "
            f"loading before adding devices): {workers.setting.format(wanted)} (measured: {needed:.1f} workers per "
            f"device keep up; now {workers.count})"
        )
    if len(ranks) > 1 and pace.comm is not None and pace.comm / step > COMM_BOUND:
        larger = "data.per_device_batch_size" + ("" if manual_optimization else ", or trainer.accumulate_grad_batches")
        lines.append(
            f"communication-bound: {pace.comm / step:.0%} of the step waits for the gradient all-reduce (above "
            f"~{COMM_BOUND:.0%} scaling is far from linear): a larger per-device batch ({larger}), "
            "strategy.bucket_cap_mb, or fewer devices; the estimate for another device count: python train.py "
            "dry_run=true trainer.devices=M diagnostics_from=<this run>"
        )
    if straggler := find_straggler(ranks):
        node = straggler.rank // max(devices_per_node, 1)
        lines.append(straggler_line(straggler, f"node {node}; its host is named in the warning above"))
    return lines
