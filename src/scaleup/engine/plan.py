"""The batch and learning-rate plan, resolved once before any process starts.

Global-first: the user says how many samples make one optimizer step (the global batch); the plan works out
the per-device batch for the topology. Moving to more devices then changes the speed, not the optimisation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from scaleup.engine.callbacks.lr_scaling import DECAYS, LRSchedule, lr_factor
from scaleup.engine.errors import UserError

# Fewer samples than this per BatchNorm statistic make the statistics noisy enough to cost accuracy; from here up
# they are reliable unsynced. Goyal et al. 2017 trained ResNet-50 at a global batch of 8k with BN over 32 images
# per GPU, unsynced, matching the small-batch baseline; Wu & He 2018 (Group Normalization, fig. 1) show BN's error
# rising as the per-device batch drops below 32. SyncBN adds a collective to every BN layer, so `auto` syncs only
# below this, and the pitfall warning uses the same line.
SMALL_BN_BATCH = 32


@dataclass(frozen=True)
class Topology:
    accelerator: str  # "cpu" or "gpu"
    devices: int  # per node
    num_nodes: int

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes


def resolve_topology(trainer_cfg: dict[str, Any], *, dry_run: bool = False) -> Topology:
    """Turn `trainer.accelerator/devices/num_nodes` into numbers, and refuse what this machine cannot run."""
    accelerator = str(trainer_cfg.get("accelerator", "auto"))
    if accelerator in ("cuda", "gpu"):
        accelerator = "gpu"
    elif accelerator == "auto":
        # A dry run plans for the cluster, not for the laptop it runs on.
        accelerator = "gpu" if dry_run or torch.cuda.is_available() else "cpu"
    elif accelerator != "cpu":
        raise UserError(f"trainer.accelerator={accelerator} is not supported here; use auto, gpu or cpu")

    devices = trainer_cfg.get("devices", 1)
    if isinstance(devices, str) and devices not in ("auto", "-1"):
        devices = [d for d in devices.split(",") if d.strip()]
    if isinstance(devices, list | tuple):
        devices = len(devices)
    elif devices in ("auto", "-1", -1):
        devices = torch.cuda.device_count() if accelerator == "gpu" and not dry_run else 1
    devices = int(devices)
    num_nodes = int(trainer_cfg.get("num_nodes", 1))
    if devices < 1 or num_nodes < 1:
        raise UserError(f"trainer.devices={devices} and trainer.num_nodes={num_nodes} must both be at least 1")
    if accelerator == "gpu" and not dry_run:
        visible = torch.cuda.device_count()
        if visible == 0:
            raise UserError("trainer.accelerator=gpu but no GPU is visible; use trainer.accelerator=cpu")
        if devices > visible:
            raise UserError(
                f"trainer.devices={devices} but only {visible} GPU(s) are visible on this node; "
                f"use trainer.devices={visible} (or check CUDA_VISIBLE_DEVICES)"
            )
    return Topology(accelerator, devices, num_nodes)


@dataclass(frozen=True)
class BatchPlan:
    per_device: int
    accumulation: int
    world_size: int

    @property
    def global_(self) -> int:
        return self.per_device * self.accumulation * self.world_size


def resolve_batch(
    global_batch_size: int | None,
    per_device_batch_size: int | None,
    world_size: int,
    accumulation: int | None,
    max_per_device: int | None = None,
) -> BatchPlan:
    """per-device = global / (world_size x accumulation); an error naming the numbers if it does not divide.

    `accumulation` None means not set: 1, or with a per-device cap the smallest that keeps each device at or below
    it (`accumulation_for_cap`).
    """
    if (global_batch_size is None) == (per_device_batch_size is None):
        raise UserError(
            "set exactly one of data.global_batch_size (the recipe: same results on any device count) or "
            "data.per_device_batch_size (throughput mode: the global batch grows with devices); "
            f"got global={global_batch_size}, per_device={per_device_batch_size}. "
            "To switch, pass e.g. data.global_batch_size=null data.per_device_batch_size=64"
        )
    for key, size in (("global_batch_size", global_batch_size), ("per_device_batch_size", per_device_batch_size)):
        if size is not None and size < 1:
            raise UserError(f"data.{key}={size} must be at least 1")
    if max_per_device is not None:
        accumulation = accumulation_for_cap(
            global_batch_size, per_device_batch_size, world_size, accumulation, max_per_device
        )
    accumulation = accumulation or 1
    if per_device_batch_size is not None:
        return BatchPlan(int(per_device_batch_size), accumulation, world_size)
    shards = world_size * accumulation
    if global_batch_size % shards:
        raise UserError(
            f"data.global_batch_size={global_batch_size} does not divide into {world_size} device(s) x "
            f"{accumulation} accumulation step(s) = {shards} equal per-device batches; choose a global batch "
            f"that is a multiple of {shards} (e.g. {max(1, round(global_batch_size / shards)) * shards})"
        )
    return BatchPlan(global_batch_size // shards, accumulation, world_size)


def accumulation_for_cap(
    global_batch_size: int | None,
    per_device_batch_size: int | None,
    world_size: int,
    accumulation: int | None,
    cap: int,
) -> int:
    """The smallest accumulation that splits the global batch exactly into per-device batches of at most `cap`.

    One GPU with a cap of 32 runs an 8-GPU recipe of global batch 256 as 8 accumulation steps of 32: the same
    samples per optimizer step, so the same optimisation, in the memory of 32. A cap above the per-device share
    is no contradiction: it only bites on fewer devices, which is what lets one command run on any count.
    """
    if per_device_batch_size is not None:
        raise UserError(
            f"data.max_per_device_batch_size={cap} caps the per-device share of a fixed global batch, but "
            f"data.per_device_batch_size={per_device_batch_size} fixes the per-device batch itself; set "
            "data.global_batch_size instead (and data.per_device_batch_size=null), or drop the cap"
        )
    if cap < 1:
        raise UserError(f"data.max_per_device_batch_size={cap} must be at least 1 (or null for no cap, or auto)")
    if global_batch_size % world_size:
        raise UserError(
            f"data.global_batch_size={global_batch_size} does not split evenly over {world_size} device(s), so no "
            f"accumulation gives equal per-device batches; choose a multiple of {world_size}"
        )
    share = global_batch_size // world_size
    derived = next(steps for steps in range(1, share + 1) if share % steps == 0 and share // steps <= cap)
    if accumulation is not None and accumulation != derived:
        raise UserError(
            f"trainer.accumulate_grad_batches={accumulation} contradicts data.max_per_device_batch_size={cap}: a "
            f"global batch of {global_batch_size} on {world_size} device(s) needs accumulation {derived} to keep "
            f"each device at or below {cap} ({share // derived} per device). Remove trainer.accumulate_grad_batches "
            "(the cap derives it) or the cap"
        )
    return derived


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
    base_lrs: dict[str, float]  # each param group's LR from configure_optimizers, valid at base_batch_size
    base_lr: float | None  # the one base LR all groups share (None when they differ)
    base_batch_size: int
    scaling_rule: str
    lr_factor: float  # peak LR / base LR, the same for every group
    lr: float | None  # the scaled peak of base_lr
    # The step counts are None in a dry run whose data module cannot state its split sizes without the files.
    warmup_steps: int | None
    decay: str
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
    sync_batchnorm_reason: str = ""
    early_stopping: str | None = None  # e.g. "val/acc (max, patience 5)": the run may end before total_steps
    epoch_limit: str = ""  # the Lightning debug flag that shortens each epoch, e.g. "trainer.overfit_batches=3"

    def with_per_device_batch(self, per_device: int) -> Plan:
        """This plan with its global batch split into micro-batches of `per_device` (what the auto cap settles)."""
        return replace(
            self,
            per_device_batch_size=per_device,
            accumulate_grad_batches=self.global_batch_size // (self.world_size * per_device),
            bn_batch_size=bn_batch(per_device, self.world_size, self.sync_batchnorm, self.has_batchnorm),
        )

    def schedule(self, milestones_epochs: tuple[float, ...] = (), gamma: float = 0.1) -> LRSchedule:
        return LRSchedule(
            peak=self.lr_factor,
            warmup_steps=self.warmup_steps,
            total_steps=self.total_steps,
            decay=self.decay,
            milestones=tuple(round(m * self.steps_per_epoch) for m in milestones_epochs),
            gamma=gamma,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def rows(self) -> list[tuple[str, str]]:
        sizes = ", ".join(f"{k} {v}" for k, v in self.dataset_sizes.items())
        return [
            (
                "world size",
                f"{self.world_size} = {self.num_nodes} node(s) x {self.devices} {self.accelerator}",
            ),
            ("per-device batch", self._per_device_row()),
            ("accumulation", self._accumulation_row()),
            ("global batch", f"{self.global_batch_size} ({self.batch_mode} mode)"),
            ("learning rate", self._lr_row()),
            ("warmup / total steps", f"{known(self.warmup_steps)} / {known(self.total_steps)} ({self.decay} decay)"),
            ("steps per epoch", known(self.steps_per_epoch) + (f" ({self.epoch_limit})" if self.epoch_limit else "")),
            ("BatchNorm batch", self._bn_row()),
            ("SyncBatchNorm", f"{'on' if self.sync_batchnorm else 'off'} ({self.sync_batchnorm_reason})"),
            ("precision / strategy", f"{self.precision} / {self.strategy}"),
            ("TF32 / channels_last", f"{'on' if self.tf32 else 'off'} / {'on' if self.channels_last else 'off'}"),
            *([("early stopping", self._early_stopping_row())] if self.early_stopping else []),
            ("seed", str(self.seed)),
            ("data", sizes or "unknown until the data is there (the data module cannot state its sizes)"),
        ]

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
        tuned = f"; tuned at {self.base_bn_batch_size}"
        if self.bn_batch_size is None:
            synced = f" x {self.world_size} devices (SyncBN)" if self.sync_batchnorm else ""
            return f"the probed micro-batch{synced}{tuned}"
        if self.sync_batchnorm:
            return f"{self.bn_batch_size} = {self.world_size} devices x {self.per_device_batch_size} (SyncBN){tuned}"
        return f"{self.bn_batch_size} (the per-device micro-batch){tuned}"

    def _early_stopping_row(self) -> str:
        return (
            f"{self.early_stopping}: may end the run before step {self.total_steps}; "
            f"the LR schedule still spans all {self.total_steps}"
        )

    def _lr_row(self) -> str:
        if self.base_lr is not None:
            return (
                f"{self.base_lr:g} @ {self.base_batch_size} -> {self.lr:g} @ {self.global_batch_size} "
                f"({self.scaling_rule})"
            )
        groups = ", ".join(f"{name} {lr:g} -> {lr * self.lr_factor:g}" for name, lr in self.base_lrs.items())
        scaling = f"x{self.lr_factor:g} @ {self.global_batch_size} over {self.base_batch_size} ({self.scaling_rule})"
        return f"{scaling}: {groups}"


def total_steps(steps_per_epoch: int, max_epochs: int | None, max_steps: int | None) -> int:
    """Optimizer steps the Trainer will take, by Lightning's own rule (max_epochs defaults to 1000)."""
    max_steps = -1 if max_steps is None else int(max_steps)
    if max_epochs is None or int(max_epochs) < 0:
        max_epochs = 1000 if max_steps == -1 else None
    by_epochs = steps_per_epoch * int(max_epochs) if max_epochs is not None else math.inf
    by_steps = max_steps if max_steps != -1 else math.inf
    steps = min(by_epochs, by_steps)
    if steps == math.inf:
        raise UserError("set trainer.max_epochs or trainer.max_steps")
    return int(steps)


def known(value: Any) -> str:
    return "unknown" if value is None else str(value)


def batch_limit(batches: int, limit: float | None) -> int:
    """Lightning's reading of a `limit_*_batches`-style value: an int (or a whole float above 1) caps the count,
    a float in [0, 1] is a share of it, rounded down."""
    if limit is None:
        return batches
    if isinstance(limit, float) and limit <= 1.0:
        return int(batches * limit)
    return min(batches, int(limit))


def epoch_steps(train_size: int | None, batch: BatchPlan, trainer_cfg: Mapping[str, Any]) -> tuple[int | None, str]:
    """Optimizer steps per epoch as Lightning takes them, and the debug flag that shortens the epoch ("" if none).

    A full epoch is the global batches the training set fills (the sampler skips the tail). Lightning's debug
    flags cut it short, counting each rank's loader batches (micro-batches): `limit_train_batches` and
    `fast_dev_run` keep a number or a share of them, `overfit_batches` likewise but of the sequential loader
    Lightning swaps in, which keeps the tail. An epoch that ends inside an accumulation still steps: rounded up.
    """
    if train_size is None:
        return None, ""
    batches = train_size // batch.global_ * batch.accumulation
    fast_dev_run = int(trainer_cfg.get("fast_dev_run") or 0)  # True is 1 batch
    if trainer_cfg.get("overfit_batches"):
        flag = "overfit_batches"
        batches = math.ceil(math.ceil(train_size / batch.world_size) / batch.per_device)
    else:
        flag = "fast_dev_run" if fast_dev_run else "limit_train_batches"
    limit = fast_dev_run if flag == "fast_dev_run" else trainer_cfg.get(flag)
    limited = batch_limit(batches, limit)
    if limited == 0 and limit:
        raise UserError(f"trainer.{flag}={limit} keeps less than one of the {batches} batches per epoch; raise it")
    shortened = limited != batches or flag == "overfit_batches"
    return math.ceil(limited / batch.accumulation), f"trainer.{flag}={limit}" if shortened else ""


def run_steps(steps_per_epoch: int | None, trainer_cfg: Mapping[str, Any]) -> int | None:
    """Optimizer steps of the whole run; `fast_dev_run=n` makes Lightning run one epoch of at most n steps."""
    if steps_per_epoch is None:
        return None
    fast_dev_run = int(trainer_cfg.get("fast_dev_run") or 0)
    if fast_dev_run:
        return total_steps(steps_per_epoch, 1, fast_dev_run)
    return total_steps(steps_per_epoch, trainer_cfg.get("max_epochs"), trainer_cfg.get("max_steps"))


def build_plan(
    *,
    topology: Topology,
    trainer_cfg: dict[str, Any],
    data_cfg: dict[str, Any],
    lr_cfg: dict[str, Any],
    base_lrs: Mapping[str, float],
    seed: int,
    dataset_sizes: dict[str, int],
    has_batchnorm: bool,
    strategy: str,
    early_stopping: Mapping[str, Any] | None = None,
) -> Plan:
    accumulation = trainer_cfg.get("accumulate_grad_batches")
    if accumulation is not None and int(accumulation) < 1:
        raise UserError(f"trainer.accumulate_grad_batches={accumulation} must be at least 1")
    cap = data_cfg.get("max_per_device_batch_size")
    if cap == "auto":
        check_auto_cap(data_cfg.get("per_device_batch_size"), accumulation, strategy)
    elif cap is not None and not isinstance(cap, int):
        raise UserError(f"data.max_per_device_batch_size={cap} must be a number, auto, or null (no cap)")
    batch = resolve_batch(
        data_cfg.get("global_batch_size"),
        data_cfg.get("per_device_batch_size"),
        topology.world_size,
        None if accumulation is None else int(accumulation),
        None if cap == "auto" else cap,
    )
    train_size = dataset_sizes.get("train")  # None: a dry run before the data is there
    if train_size is not None and train_size < batch.global_:
        raise UserError(
            f"the global batch ({batch.global_}) is larger than the training set ({train_size} samples); "
            "lower data.global_batch_size"
        )
    for split in ("val", "test"):
        if 0 < dataset_sizes.get(split, 0) < topology.world_size:
            raise UserError(
                f"the {split} split has {dataset_sizes[split]} samples, fewer than the {topology.world_size} "
                "processes: every process needs at least one sample to evaluate"
            )
    steps_per_epoch, epoch_limit = epoch_steps(train_size, batch, trainer_cfg)

    rule = str(lr_cfg.get("rule", "linear"))
    base_batch = int(lr_cfg.get("base_batch_size", batch.global_))
    factor = lr_factor(batch.global_, base_batch, rule)
    distinct_lrs = set(base_lrs.values())
    shared_lr = distinct_lrs.pop() if len(distinct_lrs) == 1 else None
    decay = str(lr_cfg.get("decay", "none"))
    if decay not in DECAYS:
        raise UserError(f"callbacks.lr_scaling.decay={decay} is not one of {', '.join(DECAYS)}")
    warmup_epochs, warmup_steps = lr_cfg.get("warmup_epochs"), lr_cfg.get("warmup_steps")
    if warmup_epochs and warmup_steps:
        raise UserError(
            "set callbacks.lr_scaling.warmup_epochs or callbacks.lr_scaling.warmup_steps, not both "
            f"(got {warmup_epochs} epochs and {warmup_steps} steps)"
        )
    if warmup_steps or not warmup_epochs:
        warmup = int(warmup_steps or 0)
    else:
        warmup = None if steps_per_epoch is None else round(float(warmup_epochs) * steps_per_epoch)
    # With an auto cap the micro-batch is known only after the probe; SyncBN is decided before it (Lightning
    # converts the layers during setup) on the largest micro-batch the probe can pick.
    sync, sync_reason = resolve_sync_batchnorm(
        trainer_cfg.get("sync_batchnorm", "auto"), topology, has_batchnorm, batch.per_device
    )
    if cap == "auto" and has_batchnorm:
        sync_reason += " (decided before the probe, on its largest split)"

    return Plan(
        world_size=topology.world_size,
        num_nodes=topology.num_nodes,
        devices=topology.devices,
        accelerator=topology.accelerator,
        per_device_batch_size=batch.per_device,
        accumulate_grad_batches=batch.accumulation,
        global_batch_size=batch.global_,
        batch_mode="global" if data_cfg.get("global_batch_size") is not None else "per_device",
        base_lrs=dict(base_lrs),
        base_lr=shared_lr,
        base_batch_size=base_batch,
        scaling_rule=rule,
        lr_factor=factor,
        lr=None if shared_lr is None else shared_lr * factor,
        warmup_steps=warmup,
        decay=decay,
        steps_per_epoch=steps_per_epoch,
        total_steps=run_steps(steps_per_epoch, trainer_cfg),
        sync_batchnorm=sync,
        precision=resolve_precision(trainer_cfg.get("precision", "auto"), topology.accelerator),
        tf32=bool(trainer_cfg.get("tf32", True)) and topology.accelerator == "gpu",
        channels_last=bool(trainer_cfg.get("channels_last", False)),
        strategy=strategy,
        seed=int(seed),
        dataset_sizes=dict(dataset_sizes),
        epoch_limit=epoch_limit,
        max_per_device_batch_size=cap,
        has_batchnorm=has_batchnorm,
        bn_batch_size=None if cap == "auto" else bn_batch(batch.per_device, topology.world_size, sync, has_batchnorm),
        base_bn_batch_size=int(lr_cfg.get("base_bn_batch_size") or base_batch),
        sync_batchnorm_reason=sync_reason,
        early_stopping=describe_early_stopping(early_stopping),
    )


def check_auto_cap(per_device_batch_size: int | None, accumulation: int | None, strategy: str) -> None:
    """`max_per_device_batch_size=auto` derives the accumulation from a fixed global batch, on full replicas."""
    conflict = None
    if per_device_batch_size is not None:
        conflict = f"data.per_device_batch_size={per_device_batch_size} fixes the per-device batch itself"
    elif accumulation is not None:
        conflict = f"trainer.accumulate_grad_batches={accumulation} fixes the accumulation it would derive"
    elif "FSDP" in strategy:
        conflict = "trainer=fsdp shards the model, and the probe measures one whole replica per device"
    if conflict:
        raise UserError(
            f"data.max_per_device_batch_size=auto finds the largest per-device share of a fixed global batch that "
            f"fits, but {conflict}; drop one of the two (or give the cap as a number)"
        )


def bn_batch(per_device: int, world_size: int, sync_batchnorm: bool, has_batchnorm: bool) -> int | None:
    """Samples each BatchNorm statistic sees: the per-device micro-batch, or all devices' with SyncBN.

    Never the optimizer step's batch when there is accumulation: BN normalises each forward pass on its own
    (with SyncBN too; Lightning issue #17446).
    """
    if not has_batchnorm:
        return None
    return per_device * world_size if sync_batchnorm else per_device


def describe_early_stopping(cfg: Mapping[str, Any] | None) -> str | None:
    if not cfg:
        return None
    return f"{cfg.get('monitor')} ({cfg.get('mode', 'min')}, patience {cfg.get('patience', 3)})"


def resolve_sync_batchnorm(setting: Any, topology: Topology, has_batchnorm: bool, per_device: int) -> tuple[bool, str]:
    """Whether to sync BatchNorm across devices, and why.

    `auto` syncs when it can run (GPU, more than one process; torch refuses it on CPU) and the per-device
    micro-batch is below SMALL_BN_BATCH: then BN sees devices x micro-batch samples instead of too few. From
    SMALL_BN_BATCH up, per-device statistics are good enough, and skipping SyncBN saves a collective per BN layer.
    """
    if setting in ("auto", None):
        if not has_batchnorm:
            return False, "no BatchNorm layers"
        if topology.world_size == 1:
            return False, "auto: one process, nothing to sync"
        if topology.accelerator != "gpu":
            return False, "auto: torch's SyncBatchNorm runs on GPUs only"
        if per_device < SMALL_BN_BATCH:
            return True, f"auto: {per_device} samples per device < {SMALL_BN_BATCH}"
        return False, f"auto: {per_device} samples per device >= {SMALL_BN_BATCH} are enough per statistic"
    if setting and topology.accelerator == "cpu" and topology.world_size > 1:
        raise UserError(
            "trainer.sync_batchnorm=true cannot run on CPU (torch's SyncBatchNorm needs GPUs); "
            "use trainer.sync_batchnorm=auto, or model.net.norm=group for batch-independent normalisation"
        )
    return bool(setting), "set by trainer.sync_batchnorm"


def resolve_precision(setting: Any, accelerator: str) -> str:
    """`auto`: bf16-mixed on GPUs with native bf16 (Ampere and newer), 16-mixed on older GPUs, 32-true on CPU.

    CPU stays in float32 so that runs there stay comparable bit for bit (and float64 stays an explicit choice:
    `64-true`). A dry run without a GPU plans for current GPUs: bf16-mixed. Any other value passes through.
    """
    if str(setting) != "auto":
        return str(setting)
    if accelerator == "cpu":
        return "32-true"
    if not torch.cuda.is_available():
        return "bf16-mixed"
    return "bf16-mixed" if torch.cuda.is_bf16_supported(including_emulation=False) else "16-mixed"
