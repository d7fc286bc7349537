"""Should this job use more devices? An estimate of the step time and speedup on M devices from a run on N.

`python train.py dry_run=true trainer.devices=M diagnostics_from=<run dir>` reads the run's plan.json and the
per-rank step times its metrics.json holds (scaleup.observability.step_time) and applies a simple model:

- compute and data wait per sample stay as measured (the median rank's, a straggler left out), so a device's time
  per optimizer step is accumulation x per-device batch x (compute + data wait) per sample;
- the gradient all-reduce is a ring all-reduce, 2(M-1)/M x gradient bytes / bandwidth, with the bandwidth that
  makes the measured run's exposed communication (its pace-setting rank's wait in the reduction) come out: the
  exposed part scales by (2(M-1)/M) / (2(N-1)/N), and the gradient bytes cancel;
- the step is the two added: the communication the measured run hid behind its backward stays hidden in the same
  proportion.

What it leaves out, printed with every estimate: a smaller per-device batch usually runs at a lower rate per sample
on a GPU (optimistic), a shorter backward hides less communication (optimistic when the per-device batch shrinks),
and a network between nodes is usually slower than the links within one (a run on one node says nothing about
several). From a 1-device run there is no communication to scale: the estimate is compute alone, a lower bound.
The estimate scales the measured run's own step times: where the planned run has another model, data, precision or
accelerator, it says so first, loudly (`differences`).
"""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from scaleup.errors import UserError
from scaleup.observability.step_time import find_straggler, pace_setter, ranks_from_metrics


@dataclass(frozen=True)
class Target:
    """The topology to estimate: M devices in all, on `num_nodes` nodes, with the plan's batch split."""

    world_size: int
    num_nodes: int
    per_device_batch: int
    accumulation: int

    @property
    def global_batch(self) -> int:
        return self.world_size * self.accumulation * self.per_device_batch


@dataclass(frozen=True)
class Measured(Target):
    """A run's topology and its step times: compute and data wait in seconds per training batch (the median of
    the ranks', a straggler left out), exposed communication and the measured step in seconds per optimizer step
    (the pace-setting rank's)."""

    compute: float
    data_wait: float
    comm: float | None
    step: float
    gradient_bytes: int = 0
    straggler: int | None = None


@dataclass(frozen=True)
class Estimate:
    """Seconds per optimizer step on the target (`comm` None: unknown, left out), its throughput, and the speedup
    over the measured run and over one device computing the same samples at the measured rate."""

    step: float
    work: float
    comm: float | None
    samples_per_s: float
    over_measured: float
    over_one: float

    def efficiency(self, world_size: int) -> float:
        return self.over_one / world_size


def ring(world_size: int) -> float:
    """A ring all-reduce's traffic per byte of gradient, per device: 2(M-1)/M."""
    return 2 * (world_size - 1) / world_size


def estimate(measured: Measured, target: Target) -> Estimate:
    """The model of the module docstring applied to `target`."""
    per_sample = (measured.compute + measured.data_wait) / measured.per_device_batch
    work = target.accumulation * target.per_device_batch * per_sample
    if target.world_size == 1:
        comm = 0.0
    elif measured.world_size > 1 and measured.comm is not None:
        comm = measured.comm * ring(target.world_size) / ring(measured.world_size)
    else:
        comm = None
    step = work + (comm or 0.0)
    samples_per_s = target.global_batch / step
    return Estimate(
        step=step,
        work=work,
        comm=comm,
        samples_per_s=samples_per_s,
        over_measured=samples_per_s / (measured.global_batch / measured.step),
        over_one=target.global_batch * per_sample / step,
    )


def gradient_bytes(parameters: int, precision: str) -> int:
    """Bytes of gradient DDP reduces: 8 per parameter in float64, 2 in a half precision's `-true`, else 4 (the
    mixed precisions keep float32 weights, and so float32 gradients)."""
    if precision.startswith("64"):
        return 8 * parameters
    return (2 if precision in ("bf16-true", "16-true") else 4) * parameters


def in_units(size: float) -> str:
    """A byte count in kB, MB or GB, 3 significant digits."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size:.0f} B"


def measured_run(directory: str) -> Measured:
    """The measured figures of the run in `directory` (its plan.json and metrics.json); a UserError where they are
    not there."""
    run = Path(directory)
    plan_file, metrics_file = run / "plan.json", run / "metrics.json"
    if missing := [file.name for file in (plan_file, metrics_file) if not file.is_file()]:
        where = "is not a directory" if not run.is_dir() else f"has no {' and no '.join(missing)}"
        raise UserError(
            f"diagnostics_from={directory} {where}: pass the directory of a training run whose training ended (a "
            "run writes plan.json when it starts and metrics.json when its training ends)"
        )
    plan, metrics = json.loads(plan_file.read_text()), json.loads(metrics_file.read_text())
    ranks = ranks_from_metrics(metrics)
    if not ranks:
        raise UserError(
            f"diagnostics_from={directory}: its metrics.json holds no per-rank step times (perf/rank0/compute_s ...): "
            "they are logged at the end of each training epoch by the diagnostics callback (callbacks=default)"
        )
    pace = ranks[pace_setter(ranks)]
    accumulation = int(plan["accumulate_grad_batches"])
    straggler = find_straggler(ranks)
    # The healthy ranks' rate: a straggler left out (of 2 ranks, the median would be its mean with the other's).
    healthy = [times for rank, times in enumerate(ranks) if straggler is None or rank != straggler.rank]
    return Measured(
        world_size=int(plan["world_size"]),
        num_nodes=int(plan["num_nodes"]),
        per_device_batch=int(plan["per_device_batch_size"]),
        accumulation=accumulation,
        compute=statistics.median(r.compute for r in healthy),
        data_wait=statistics.median(r.data_wait for r in healthy),
        comm=None if pace.comm is None else pace.comm * accumulation,
        step=pace.step * accumulation,
        gradient_bytes=gradient_bytes(int(plan.get("trainable_parameters", 0)), str(plan.get("precision", ""))),
        straggler=straggler.rank if straggler else None,
    )


def target_of(plan: dict[str, Any]) -> Target:
    """The topology and batch split of a plan (Plan.to_dict())."""
    return Target(
        int(plan["world_size"]),
        int(plan["num_nodes"]),
        int(plan["per_device_batch_size"]),
        int(plan["accumulate_grad_batches"]),
    )


def estimate_lines(measured: Measured, target: Target, source: str) -> list[str]:
    """The estimate in words, with what it assumes."""
    ms = 1000
    model = estimate(measured, measured)
    result = estimate(measured, target)
    lines = [
        f"speedup estimate from {source}: {measured.world_size} device(s) on {measured.num_nodes} node(s), per-device "
        f"batch {measured.per_device_batch} x {measured.accumulation} accumulation, measured "
        f"{ms * measured.step:.1f} ms per optimizer step (the model gives {ms * model.step:.1f} ms)",
    ]
    comm = "no communication measured (1 device)"
    if measured.comm is not None and measured.world_size > 1:
        comm = f"exposed communication {ms * measured.comm:.2f} ms per optimizer step"
        if measured.gradient_bytes and measured.comm > 0:
            bandwidth = ring(measured.world_size) * measured.gradient_bytes / measured.comm
            comm += (
                f" (apparent bandwidth {in_units(bandwidth)}/s for {in_units(measured.gradient_bytes)} of gradients)"
            )
    elif measured.comm is None:
        comm = "communication not measured (strategy=fsdp, or a comm hook of the run's own)"
    ranks = "median rank" if measured.straggler is None else f"median of the ranks but {measured.straggler}"
    lines.append(
        f"  measured per training batch ({ranks}): compute {ms * measured.compute:.2f} ms, data wait "
        f"{ms * measured.data_wait:.2f} ms; {comm}"
    )
    comm_part = "communication unknown (left out)" if result.comm is None else f"{ms * result.comm:.2f} ms all-reduce"
    lines.append(
        f"  on {target.world_size} device(s) (per-device batch {target.per_device_batch} x {target.accumulation} "
        f"accumulation, global {target.global_batch}): about {ms * result.step:.1f} ms per optimizer step "
        f"({ms * result.work:.1f} ms compute and data wait + {comm_part}), {result.samples_per_s:,.0f} samples/s: "
        f"{result.over_measured:.2f}x the measured run, {result.over_one:.2f}x one device "
        f"(efficiency {result.efficiency(target.world_size):.0%})"
    )
    if result.over_measured < 1:
        lines.append(
            f"  {target.world_size} device(s) would be slower than the measured run: keep its "
            f"{measured.world_size} device(s)"
        )
    if measured.straggler is not None:
        lines.append(
            f"  the measured run had a straggler (rank {measured.straggler}): the estimate assumes every rank "
            "computes at the other ranks' median rate"
        )
    if result.comm is None:
        lines.append("  the communication was not measured: the step time is a lower bound, the speedup an upper one")
    lines.append(
        "  assumes: compute and data wait per sample as measured (a smaller per-device batch runs at a lower rate "
        "on a GPU: optimistic); ring all-reduce, 2(M-1)/M x gradient bytes / the measured run's bandwidth; the same "
        "share of the communication hidden behind the backward (a shorter backward hides less: optimistic)"
        + (
            "; the same interconnect (between nodes it is usually slower: measure a run on 2 nodes)"
            if target.num_nodes > measured.num_nodes
            else ""
        )
    )
    return lines


def _model_name(resolved: Mapping[str, Any]) -> str:
    """The model's class and its network's, as a run's resolved config (its config.yaml) names them:
    `ImageClassifier(DigitsCNN)`."""
    model = resolved.get("model") or {}
    name = str(model.get("_target_", "?")).rsplit(".", 1)[-1]
    net = model.get("net")
    if isinstance(net, Mapping) and "_target_" in net:
        return f"{name}({str(net['_target_']).rsplit('.', 1)[-1]})"
    return name


def _data_name(resolved: Mapping[str, Any]) -> str:
    """The data module's class, as a run's resolved config names it."""
    return str((resolved.get("data") or {}).get("_target_", "?")).rsplit(".", 1)[-1]


def differences(directory: str, plan: dict[str, Any], config: Mapping[str, Any]) -> list[str]:
    """What the measured run in `directory` differs in from the planned one (`plan`, `config`: its plan and
    resolved config): `what measured -> planned` for its model (class, network, parameter count), data (class),
    precision and accelerator. Its step times are those of its own model, data, precision and accelerator."""
    run = Path(directory)
    measured_plan = json.loads((run / "plan.json").read_text())
    found = []
    if (run / "config.yaml").is_file():  # the resolved config every run writes
        measured_config = OmegaConf.to_container(OmegaConf.load(run / "config.yaml"))
        then, now = (
            f"{_model_name(c)}, {int(p.get('parameters', 0)):,} parameters"
            for c, p in ((measured_config, measured_plan), (config, plan))
        )
        if then != now:
            found.append(f"model {then} -> {now}")
        if (then := _data_name(measured_config)) != (now := _data_name(config)):
            found.append(f"data {then} -> {now}")
    for key in ("precision", "accelerator"):
        if (then := measured_plan.get(key)) != (now := plan.get(key)):
            found.append(f"{key} {then} -> {now}")
    return found


def differences_line(found: list[str], source: str) -> str:
    """The warning that the estimate is of another run than the planned one."""
    return (
        f"the measured run ({source}) is not this run: {'; '.join(found)}. The estimate scales its step times, so it "
        "is for its model, data, precision and accelerator on the planned devices: measure a short run of this one "
        "and estimate from it"
    )


def speedup_report(source: str, plan: dict[str, Any], config: Mapping[str, Any]) -> list[tuple[int, str]]:
    """A dry run's estimate from the measured run in `source` for its plan (`plan`, `config`: Plan.to_dict() and the
    resolved config), as (log level, line): a warning first where the measured run is another run. A UserError
    where `source` holds no measured run."""
    measured = measured_run(source)
    found = differences(source, plan, config)
    warning = [(logging.WARNING, differences_line(found, source))] if found else []
    return warning + [(logging.INFO, line) for line in estimate_lines(measured, target_of(plan), source)]
