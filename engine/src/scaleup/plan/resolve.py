"""The batch and learning-rate plan, resolved once before any process starts.

Global-first: the user says how many samples make one optimizer step (the global batch); the plan works out
the per-device batch for the topology. Moving to more devices then changes the speed, not the optimisation.
"""

from __future__ import annotations

import inspect
import pkgutil
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Protocol

from scaleup.distributed.clusters import Launcher
from scaleup.errors import UserError
from scaleup.observability.rows import shown
from scaleup.plan.batch import BatchPlan, check_auto_cap, epoch_steps, resolve_batch, run_steps
from scaleup.plan.lr import LRSchedule, lr_factor
from scaleup.plan.topology import Topology, resolve_precision

if TYPE_CHECKING:
    from scaleup.config.schema import DataBatches, LRScheduleSettings, Performance, TrainerArgs

# Fewer samples than this per BatchNorm statistic make the statistics noisy enough to cost accuracy; from here up
# they are reliable unsynced. Goyal et al. 2017 trained ResNet-50 at a global batch of 8k with BN over 32 images
# per GPU, unsynced, matching the small-batch baseline; Wu & He 2018 (Group Normalization, fig. 1) show BN's error
# rising as the per-device batch drops below 32. SyncBN adds a collective to every BN layer, so `auto` syncs only
# below this, and the pitfall warning uses the same line.
SMALL_BN_BATCH = 32


class PlanRecord(Protocol):
    """An extra's facts in the plan (e.g. strategy=fsdp's sharding, `distributed/fsdp.py`'s `Sharding`): plan.json
    holds `to_dict()` under `key`, the printed plan shows `rows(plan)` after the precision and strategy."""

    key: str

    def to_dict(self) -> dict[str, Any]: ...

    def rows(self, plan: Plan) -> list[tuple[str, str]]: ...


@dataclass(frozen=True)
class StoredRecord:
    """A record as a stored plan holds it (plan.json, a checkpoint's `scaleup.plan`), read back by the core, which
    does not know the extra's type: its values, written again as they are; its rows are the extra's to say."""

    key: str
    values: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.values)

    def rows(self, plan: Plan) -> list[tuple[str, str]]:
        return []


@dataclass(frozen=True)
class Plan:
    world_size: int
    num_nodes: int
    devices: int
    accelerator: str
    per_device_batch_size: int
    accumulate_grad_batches: int
    global_batch_size: int
    batch_mode: str  # "global" (recipe fixed) or "per_device" (global grows with devices)
    # Each param group's LR from configure_optimizers, valid at base_batch_size. None until the run's fit starts:
    # read then from the optimizers Lightning built, its one call of configure_optimizers (callbacks/run_files.py).
    base_lrs: dict[str, float] | None
    base_lr: float | None  # the one base LR all groups share (None when they differ)
    base_batch_size: int
    scaling_rule: str
    lr_factor: float  # peak LR / base LR, the same for every group
    lr: float | None  # the scaled peak of base_lr
    # The step counts are None in a dry run whose data module cannot state its split sizes without the files.
    warmup_steps: int | None
    decay: str
    milestones: tuple[float, ...]  # epochs, for decay="step"
    gamma: float  # the LR factor at each milestone
    steps_per_epoch: int | None  # optimizer steps, as Lightning takes them (debug flags included)
    total_steps: int | None
    sync_batchnorm: bool
    precision: str  # resolved: `auto` is already bf16-mixed, 16-mixed or 32-true here
    tf32: bool  # TF32 tensor cores for float32 matmuls and convolutions (GPUs only)
    channels_last: bool  # NHWC memory layout for the network's 4-d weights
    strategy: str
    seed: int
    dataset_sizes: dict[str, int] = field(default_factory=dict)
    # The per-device cap as configured: None, a number, or "auto" (settled at the start of fit: batch_probe.py).
    max_per_device_batch_size: int | str | None = None
    has_batchnorm: bool = False
    bn_batch_size: int | None = None  # samples per BN statistic; None without BN, or with auto before the probe
    base_bn_batch_size: int | None = None  # the BN batch the recipe was tuned at
    # Why SyncBatchNorm is on or off, as a code: SYNC_BATCHNORM_RULES holds what each one means.
    sync_batchnorm_rule: str = ""
    # The callbacks' EarlyStopping (None without one): the run may end before total_steps.
    early_stopping_monitor: str | None = None
    early_stopping_mode: str | None = None
    early_stopping_patience: int | None = None
    # The Lightning debug flag that shortens each epoch (None if none) and its value, e.g. overfit_batches, 3.
    epoch_limit_flag: str | None = None
    epoch_limit_value: int | float | None = None
    # What started the processes (distributed/clusters.py): one of LAUNCHERS, torchrun's restart count, SLURM's job.
    launcher_kind: str = ""
    launcher_restarts: int = 0
    launcher_job: str = ""
    log_every_n_steps: int | None = None  # resolved: `auto` is a number here; None is Lightning's default (50)
    # BatchNorm under init (finetune.py sets these): the batch the initial weights were trained with, where it matters;
    # whether init.freeze_bn keeps every layer in eval mode (no batch statistics), else the module whose layers it
    # keeps so (init.module) and the layers outside it, which still compute batch statistics.
    trained_bn_batch_size: int | None = None
    batchnorm_frozen: bool = False
    batchnorm_frozen_module: str = ""
    batchnorm_unfrozen: tuple[str, ...] = ()
    parameters: int | None = None  # the model's parameters (None in a plan of an older version) ...
    trainable_parameters: int | None = None  # ... and those the optimizer trains
    # The module steps its optimizers itself (automatic_optimization=False): every step the plan counts (the LR
    # schedule, the step seed, trainer.max_steps, a resume) is a global batch, not an optimizer.step() call.
    manual_optimization: bool = False
    # The records of the extras that shape this run (strategy=fsdp's sharding: distributed/fsdp.py; init's initial
    # weights: finetune.py), in the order they were added: plan.json holds each under its key, the printed plan shows
    # their rows after the strategy.
    records: tuple[PlanRecord, ...] = ()

    def split(self) -> BatchPlan:
        """The global batch as the plan splits it: per-device micro-batch x accumulation x world size."""
        return BatchPlan(self.per_device_batch_size, self.accumulate_grad_batches, self.world_size)

    def with_per_device_batch(self, per_device: int) -> Plan:
        """This plan with its global batch split into micro-batches of `per_device` (what the auto cap settles: an
        exact split, so the cap's accumulation gives exactly `per_device`)."""
        batch = resolve_batch(self.global_batch_size, None, self.world_size, None, per_device)
        return replace(
            self,
            per_device_batch_size=batch.per_device,
            accumulate_grad_batches=batch.accumulation,
            bn_batch_size=bn_batch(batch.per_device, self.world_size, self.sync_batchnorm, self.has_batchnorm),
        )

    def schedule(self) -> LRSchedule:
        return LRSchedule(
            peak=self.lr_factor,
            warmup_steps=self.warmup_steps,
            total_steps=self.total_steps,
            decay=self.decay,
            milestones=tuple(round(m * self.steps_per_epoch) for m in self.milestones),
            gamma=self.gamma,
        )

    def to_dict(self) -> dict[str, Any]:
        """The plan as plan.json holds it: its fields, then each record under the record's key."""
        plain = asdict(replace(self, records=()))
        del plain["records"]
        return plain | {record.key: record.to_dict() for record in self.records}

    def with_base_lrs(self, base_lrs: Mapping[str, float]) -> Plan:
        """The plan with each param group's base LR, the one LR they share (if they do) and its scaled peak."""
        distinct = set(base_lrs.values())
        shared = distinct.pop() if len(distinct) == 1 else None
        return replace(
            self, base_lrs=dict(base_lrs), base_lr=shared, lr=None if shared is None else shared * self.lr_factor
        )

    @classmethod
    def from_dict(cls, stored: Mapping[str, Any]) -> Plan:
        """The plan `to_dict` wrote (plan.json, a checkpoint's `scaleup.plan`), typed again. A key this version does
        not know is left out (the sentences a plan before 0.3 stored, and the flat `sharding_*` and `init_*` fields of
        earlier plans, too) and one an older plan lacks takes its field's default; a plan without a field that has
        none is refused in one line. A mapping under a key that is no field is a record, kept as stored
        (StoredRecord)."""
        known = {spec.name: spec for spec in fields(cls)}
        values = {name: value for name, value in stored.items() if name in known and name != "records"}
        values["records"] = tuple(
            StoredRecord(key, value) for key, value in stored.items() if key not in known and isinstance(value, Mapping)
        )
        for name in TUPLES & values.keys():
            values[name] = tuple(values[name])  # JSON has no tuples
        missing = [
            name
            for name, spec in known.items()
            if name not in values and spec.default is MISSING and spec.default_factory is MISSING
        ]
        if missing:
            raise UserError(f"the stored plan has no {', '.join(missing)}: it was not written by scaleup's train.py")
        return cls(**values)

    def rows(self) -> list[tuple[str, str]]:
        sizes = ", ".join(f"{k} {v}" for k, v in self.dataset_sizes.items())
        return [
            (
                "world size",
                f"{self.world_size} = {self.num_nodes} node(s) x {self.devices} {self.accelerator}",
            ),
            *([("launcher", self._launcher_row())] if self.launcher_kind else []),
            *([("parameters", self._parameters_row())] if self.parameters is not None else []),
            ("per-device batch", self._per_device_row()),
            ("accumulation", self._accumulation_row()),
            ("global batch", f"{self.global_batch_size} ({self.batch_mode} mode)"),
            ("learning rate", self._lr_row()),
            ("warmup / total steps", self._steps_row()),
            ("steps per epoch", known(self.steps_per_epoch) + self._epoch_limit_note()),
            ("BatchNorm batch", self._bn_row()),
            ("SyncBatchNorm", f"{'on' if self.sync_batchnorm else 'off'} ({self._sync_batchnorm_reason()})"),
            ("precision / strategy", f"{self.precision} / {self.strategy}"),
            *(row for record in self.records for row in record.rows(self)),
            ("TF32 / channels_last", f"{'on' if self.tf32 else 'off'} / {'on' if self.channels_last else 'off'}"),
            *([("early stopping", self._early_stopping_row())] if self.early_stopping_monitor else []),
            ("seed", str(self.seed)),
            ("random numbers", self._randomness_row()),
            ("data", sizes or "unknown until the data is there (the data module cannot state its sizes)"),
        ]

    def _parameters_row(self) -> str:
        frozen = self.parameters - (self.trainable_parameters or 0)
        return f"{self.parameters:,}" + (f" ({frozen:,} frozen)" if frozen else "")

    def _randomness_row(self) -> str:
        """Which random numbers are the same on every topology (data/seeding.py)."""
        micro = "the probed micro-batch" if self.max_per_device_batch_size == "auto" else self.per_device_batch_size
        return (
            "augmentation by (seed, epoch, sample): any topology; dropout and other in-model draws by (seed, step, "
            f"micro-batch offset): any topology with micro-batches of {micro}"
        )

    def _steps_row(self) -> str:
        row = f"{known(self.warmup_steps)} / {known(self.total_steps)} ({self.decay} decay)"
        if self.manual_optimization:
            row += "; a step is a global batch (manual optimization), however many optimizer.step() calls it makes"
        if self.lr_factor <= 1:
            row += "; no warmup: the scaled LR is not above the base LR"
        return row

    def _per_device_row(self) -> str:
        cap = self.max_per_device_batch_size
        if cap == "auto":
            share = self.global_batch_size // self.world_size
            return f"auto: the largest exact split of {share} that fits, probed on every device at start"
        return str(self.per_device_batch_size) + (f" (cap {cap})" if cap is not None else "")

    def _accumulation_row(self) -> str:
        if self.max_per_device_batch_size == "auto":
            return "derived from the probe (global batch / (world size x per-device))"
        derived = " (derived from the per-device cap)" if self.max_per_device_batch_size is not None else ""
        return f"{self.accumulate_grad_batches}{derived}"

    def _bn_row(self) -> str:
        if not self.has_batchnorm:
            return "- (no BatchNorm layers)"
        if self.batchnorm_frozen:
            return "- (every BatchNorm layer in eval mode: the initial weights' statistics, init.freeze_bn)"
        tuned = f"; tuned at {self.base_bn_batch_size}"
        if self.bn_batch_size is None:
            synced = f" x {self.world_size} devices (SyncBN)" if self.sync_batchnorm else ""
            return f"the probed micro-batch{synced}{tuned}"
        if self.sync_batchnorm:
            row = f"{self.bn_batch_size} = {self.world_size} devices x {self.per_device_batch_size} (SyncBN){tuned}"
        else:
            row = f"{self.bn_batch_size} (the per-device micro-batch){tuned}"
        return row + (f"; only in {unfrozen_batchnorm(self)}" if self.batchnorm_unfrozen else "")

    def _early_stopping_row(self) -> str:
        return (
            f"{self.early_stopping_monitor} ({self.early_stopping_mode}, patience {self.early_stopping_patience}): "
            f"may end the run before step {self.total_steps}; the LR schedule still spans all {self.total_steps}"
        )

    def _epoch_limit_note(self) -> str:
        return f" (trainer.{self.epoch_limit_flag}={self.epoch_limit_value})" if self.epoch_limit_flag else ""

    def _sync_batchnorm_reason(self) -> str:
        """Why SyncBatchNorm is on or off, from the rule and the numbers it decided by."""
        # With an auto cap the rule was applied to the probe's largest split, the per-device share.
        auto = self.max_per_device_batch_size == "auto"
        per_device = self.global_batch_size // self.world_size if auto else self.per_device_batch_size
        reason = SYNC_BATCHNORM_RULES.get(self.sync_batchnorm_rule, self.sync_batchnorm_rule or "unknown")
        reason = reason.format(per_device=per_device, small=SMALL_BN_BATCH)
        if auto and self.has_batchnorm and self.sync_batchnorm_rule != "fsdp":
            reason += " (decided before the probe, on its largest split)"
        return reason

    def _launcher_row(self) -> str:
        row = LAUNCHERS.get(self.launcher_kind, self.launcher_kind)
        return row.format(restarts=self.launcher_restarts, job=self.launcher_job or "?", world_size=self.world_size)

    def _lr_row(self) -> str:
        if self.base_lr is not None:
            return (
                f"{self.base_lr:g} @ {self.base_batch_size} -> {self.lr:g} @ {self.global_batch_size} "
                f"({self.scaling_rule})"
            )
        scaling = f"x{self.lr_factor:g} @ {self.global_batch_size} over {self.base_batch_size} ({self.scaling_rule})"
        if self.base_lrs is None:
            return f"{scaling} on each param group's LR from configure_optimizers (shown when fit starts)"
        groups = ", ".join(f"{name} {lr:g} -> {lr * self.lr_factor:g}" for name, lr in self.base_lrs.items())
        return f"{scaling}: {groups}"


def unfrozen_batchnorm(plan: Plan) -> str:
    """The BatchNorm layers that still compute batch statistics under init.freeze_bn, which keeps those in
    init.module in eval mode."""
    module = plan.batchnorm_frozen_module
    return f"{shown(plan.batchnorm_unfrozen)} (init.freeze_bn keeps those in {module} in eval mode)"


def known(value: Any) -> str:
    return "unknown" if value is None else str(value)


def mib(count: int) -> str:
    return f"{count / 2**20:.2f} MiB" if count < 2**30 else f"{count / 2**30:.2f} GiB"


# The plan's fields that hold tuples (JSON gives them back as lists).
TUPLES = {"milestones", "batchnorm_unfrozen"}

# What each sync_batchnorm_rule means, as the plan prints it.
SYNC_BATCHNORM_RULES = {
    "set": "set by trainer.sync_batchnorm",
    "fsdp": "strategy=fsdp: BatchNorm statistics stay per device",
    "no_batchnorm": "no BatchNorm layers",
    "one_process": "auto: one process, nothing to sync",
    "cpu": "auto: torch's SyncBatchNorm runs on GPUs only",
    "small_batch": "auto: {per_device} samples per device < {small}",
    "large_batch": "auto: {per_device} samples per device >= {small} are enough per statistic",
}

# What each launcher_kind means (distributed/clusters.py decides which), as the plan prints it.
LAUNCHERS = {
    "dry_run": "planned only (dry run)",
    "spawn": "spawn (a sweep's processes), one process per device",
    "ray": "Ray Train, {world_size} workers: ranks from ray.train.get_context()",
    "torchrun": "torchrun, restart {restarts}: ranks from RANK, LOCAL_RANK, GROUP_RANK",
    "kubeflow_torchrun": (
        "torchrun in a Kubeflow pod (PET_* variables from the operator), restart {restarts}: ranks from RANK, "
        "LOCAL_RANK, GROUP_RANK"
    ),
    "slurm": "SLURM srun, job {job}: ranks from SLURM_PROCID, SLURM_LOCALID",
    "pytorchjob": "Kubeflow PyTorchJob, one process per pod: ranks from WORLD_SIZE, RANK (the pod's index)",
    "lightning": "Lightning's launcher, one process per device",
    "one_process": "one process",
}


def check_plan_inputs(
    *, trainer: TrainerArgs, batches: DataBatches, lr_schedule: LRScheduleSettings, strategy: str
) -> None:
    """Refuse settings that contradict each other, before anything is derived from them (each value's own type and
    range is checked before the job starts: config/schema.py)."""
    if batches.max_per_device_batch_size == "auto":
        check_auto_cap(batches.per_device_batch_size, trainer.accumulate_grad_batches, strategy)
    warmup_epochs, warmup_steps = lr_schedule.warmup_epochs, lr_schedule.warmup_steps
    if warmup_epochs and warmup_steps:
        raise UserError(
            "set lr_schedule.warmup_epochs or lr_schedule.warmup_steps, not both "
            f"(got {warmup_epochs} epochs and {warmup_steps} steps)"
        )


def check_split_sizes(dataset_sizes: Mapping[str, int], global_batch: int, world_size: int) -> None:
    """Every optimizer step needs a full global batch, and every process at least one sample to evaluate."""
    train_size = dataset_sizes.get("train")  # None: a dry run before the data is there
    if train_size is not None and train_size < global_batch:
        raise UserError(
            f"the global batch ({global_batch}) is larger than the training set ({train_size} samples); "
            "lower data.global_batch_size"
        )
    for split in ("val", "test"):
        if 0 < dataset_sizes.get(split, 0) < world_size:
            raise UserError(
                f"the {split} split has {dataset_sizes[split]} samples, fewer than the {world_size} "
                "processes: every process needs at least one sample to evaluate"
            )


def warmup_steps_for(lr_schedule: LRScheduleSettings, steps_per_epoch: int | None, factor: float) -> int | None:
    """`warmup_steps`, or `warmup_epochs` in optimizer steps (None until the epoch length is known), when the peak
    LR is above the base LR (`factor` > 1); else 0.

    Warmup keeps the first steps of a big-batch run at the LR the base recipe was tuned for and ramps from there to
    the scaled peak. At or below the base batch (or with rule=none) the scaled LR is not above the tuned one: there
    is nothing to ramp to, so the schedule starts at the peak and the decay spans the whole run (a "warmup" there
    would only hold the LR flat, and push the decay past the end of a short run).
    """
    if factor <= 1:
        return 0
    warmup_epochs, warmup_steps = lr_schedule.warmup_epochs, lr_schedule.warmup_steps
    if warmup_steps or not warmup_epochs:
        return int(warmup_steps or 0)
    return None if steps_per_epoch is None else round(float(warmup_epochs) * steps_per_epoch)


def build_plan(
    *,
    topology: Topology,
    trainer: TrainerArgs,
    batches: DataBatches,
    lr_schedule: LRScheduleSettings,
    base_lrs: Mapping[str, float] | None,
    seed: int,
    dataset_sizes: dict[str, int],
    has_batchnorm: bool,
    strategy: str,
    early_stopping: Mapping[str, Any] | None = None,
    performance: Performance,
    launcher: Launcher | None = None,
) -> Plan:
    """Check the settings, then derive the batch split, the LR schedule, BatchNorm and precision for `topology`.
    `base_lrs` None: each param group's LR is read when fit starts (Plan.base_lrs)."""
    check_plan_inputs(trainer=trainer, batches=batches, lr_schedule=lr_schedule, strategy=strategy)
    accumulation = trainer.accumulate_grad_batches
    cap = batches.max_per_device_batch_size
    batch = resolve_batch(
        batches.global_batch_size,
        batches.per_device_batch_size,
        topology.world_size,
        None if accumulation is None else int(accumulation),
        None if cap == "auto" else cap,
    )
    check_split_sizes(dataset_sizes, batch.global_, topology.world_size)
    steps_per_epoch, limit_flag, limit_value = epoch_steps(dataset_sizes.get("train"), batch, trainer)

    rule = str(lr_schedule.rule)
    base_batch = int(lr_schedule.base_batch_size)
    factor = lr_factor(batch.global_, base_batch, rule)
    # With an auto cap the micro-batch is known only after the probe; SyncBN is decided before it (Lightning
    # converts the layers during setup) on the largest micro-batch the probe can pick (the cap is left out above).
    sync, sync_rule = resolve_sync_batchnorm(
        trainer.sync_batchnorm, topology, has_batchnorm, batch.per_device, strategy
    )
    early = early_stopping_settings(early_stopping)
    launcher = launcher or Launcher("")

    plan = Plan(
        world_size=topology.world_size,
        num_nodes=topology.num_nodes,
        devices=topology.devices,
        accelerator=topology.accelerator,
        per_device_batch_size=batch.per_device,
        accumulate_grad_batches=batch.accumulation,
        global_batch_size=batch.global_,
        batch_mode="global" if batches.global_batch_size is not None else "per_device",
        base_lrs=None,
        base_lr=None,
        base_batch_size=base_batch,
        scaling_rule=rule,
        lr_factor=factor,
        lr=None,
        warmup_steps=warmup_steps_for(lr_schedule, steps_per_epoch, factor),
        decay=str(lr_schedule.decay),
        milestones=tuple(lr_schedule.milestones or ()),
        gamma=float(lr_schedule.gamma),
        steps_per_epoch=steps_per_epoch,
        total_steps=run_steps(steps_per_epoch, trainer),
        sync_batchnorm=sync,
        precision=resolve_precision(trainer.precision, topology.accelerator),
        tf32=bool(performance.tf32) and topology.accelerator == "gpu",
        channels_last=bool(performance.channels_last),
        strategy=strategy,
        seed=int(seed),
        dataset_sizes=dict(dataset_sizes),
        epoch_limit_flag=limit_flag,
        epoch_limit_value=limit_value,
        max_per_device_batch_size=cap,
        has_batchnorm=has_batchnorm,
        bn_batch_size=None if cap == "auto" else bn_batch(batch.per_device, topology.world_size, sync, has_batchnorm),
        base_bn_batch_size=int(lr_schedule.base_bn_batch_size or base_batch),
        sync_batchnorm_rule=sync_rule,
        early_stopping_monitor=early and early["monitor"],
        early_stopping_mode=early and early["mode"],
        early_stopping_patience=early and int(early["patience"]),
        launcher_kind=launcher.kind,
        launcher_restarts=launcher.restarts,
        launcher_job=launcher.job,
        log_every_n_steps=resolve_log_every_n_steps(trainer.log_every_n_steps, steps_per_epoch),
    )
    return plan if base_lrs is None else plan.with_base_lrs(base_lrs)


def bn_batch(per_device: int, world_size: int, sync_batchnorm: bool, has_batchnorm: bool) -> int | None:
    """Samples each BatchNorm statistic sees: the per-device micro-batch, or all devices' with SyncBN.

    Never the optimizer step's batch when there is accumulation: BN normalises each forward pass on its own
    (with SyncBN too; Lightning issue #17446).
    """
    if not has_batchnorm:
        return None
    return per_device * world_size if sync_batchnorm else per_device


def early_stopping_entry(callbacks_cfg: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The EarlyStopping entry of the callbacks config (`callbacks=[default,early_stopping]`), if any."""
    entries = [c for c in callbacks_cfg.values() if isinstance(c, Mapping) and "_target_" in c]
    return next((c for c in entries if str(c["_target_"]).rsplit(".", 1)[-1] == "EarlyStopping"), None)


def early_stopping_settings(entry: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The settings of the callbacks' EarlyStopping entry (monitor, mode, patience, ...); a setting the entry leaves
    out is the callback's own default."""
    if not entry:
        return None
    callback = pkgutil.resolve_name(str(entry["_target_"]))
    return {name: p.default for name, p in inspect.signature(callback).parameters.items()} | dict(entry)


LOG_EVERY_N_STEPS = 50  # Lightning's default
STEP_POINTS_PER_EPOCH = 4  # the fewest step-loss points `auto` gives an epoch


def resolve_log_every_n_steps(setting: int | str | None, steps_per_epoch: int | None) -> int | None:
    """The optimizer steps between two logging steps. `auto`: Lightning's 50, or fewer on an epoch of under 200
    steps so that it still gets 4 points of the step curve (digits at batch 64: every 4 steps).

    A logging step costs more than the others: on a CPU at 8.5 ms steps, about 0.9 ms more of the loggers, the
    step loss's `self.log`, the LR monitor and the progress bar's read (`benchmarks/step_overhead.py`), so logging
    every 10 steps costs 1% of every step, every 50 0.2%.
    """
    if setting != "auto":
        return setting
    if not steps_per_epoch:
        return LOG_EVERY_N_STEPS
    return max(1, min(LOG_EVERY_N_STEPS, steps_per_epoch // STEP_POINTS_PER_EPOCH))


def resolve_sync_batchnorm(
    setting: Any, topology: Topology, has_batchnorm: bool, per_device: int, strategy: str = "ddp"
) -> tuple[bool, str]:
    """Whether to sync BatchNorm across devices, and why: a key of SYNC_BATCHNORM_RULES.

    `auto` syncs when it can run (GPU, more than one process; torch refuses it on CPU) and the per-device
    micro-batch is below SMALL_BN_BATCH: then BN sees devices x micro-batch samples instead of too few. From
    SMALL_BN_BATCH up, per-device statistics are good enough, and skipping SyncBN saves a collective per BN layer.
    """
    if strategy == "fsdp":  # Lightning's ModelParallelStrategy would ignore trainer.sync_batchnorm silently
        if setting is True:
            raise UserError(
                "trainer.sync_batchnorm=true does not run with strategy=fsdp (it converts no layers); use "
                "trainer.sync_batchnorm=auto, model.net.norm=group, or strategy=ddp"
            )
        return False, "fsdp" if has_batchnorm else "no_batchnorm"
    if setting in ("auto", None):
        if not has_batchnorm:
            return False, "no_batchnorm"
        if topology.world_size == 1:
            return False, "one_process"
        if topology.accelerator != "gpu":
            return False, "cpu"
        if per_device < SMALL_BN_BATCH:
            return True, "small_batch"
        return False, "large_batch"
    if setting and topology.accelerator == "cpu" and topology.world_size > 1:
        raise UserError(
            "trainer.sync_batchnorm=true cannot run on CPU (torch's SyncBatchNorm needs GPUs); "
            "use trainer.sync_batchnorm=auto, or model.net.norm=group for batch-independent normalisation"
        )
    return bool(setting), "set"
