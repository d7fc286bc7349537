"""The batch and learning-rate plan, resolved once before any process starts.

Global-first: the user says how many samples make one optimizer step (the global batch); the plan works out
the per-device batch for the topology. Moving to more devices then changes the speed, not the optimisation.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from scaleup.engine.callbacks.lr_scaling import DECAYS, LRSchedule, scaled_lr
from scaleup.engine.errors import UserError


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
    global_batch_size: int | None, per_device_batch_size: int | None, world_size: int, accumulation: int
) -> BatchPlan:
    """per-device = global / (world_size x accumulation); an error naming the numbers if it does not divide."""
    if (global_batch_size is None) == (per_device_batch_size is None):
        raise UserError(
            "set exactly one of data.global_batch_size (the recipe: same results on any device count) or "
            "data.per_device_batch_size (throughput mode: the global batch grows with devices); "
            f"got global={global_batch_size}, per_device={per_device_batch_size}. "
            "To switch, pass e.g. data.global_batch_size=null data.per_device_batch_size=64"
        )
    if per_device_batch_size is not None:
        if per_device_batch_size < 1:
            raise UserError(f"data.per_device_batch_size={per_device_batch_size} must be at least 1")
        return BatchPlan(int(per_device_batch_size), accumulation, world_size)
    shards = world_size * accumulation
    if global_batch_size < 1 or global_batch_size % shards:
        raise UserError(
            f"data.global_batch_size={global_batch_size} does not divide into {world_size} device(s) x "
            f"{accumulation} accumulation step(s) = {shards} equal per-device batches; choose a global batch "
            f"that is a multiple of {shards} (e.g. {max(1, round(global_batch_size / shards)) * shards})"
        )
    return BatchPlan(global_batch_size // shards, accumulation, world_size)


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
    base_lr: float
    base_batch_size: int
    scaling_rule: str
    lr: float
    warmup_steps: int
    decay: str
    steps_per_epoch: int
    total_steps: int
    sync_batchnorm: bool
    precision: str
    strategy: str
    seed: int
    dataset_sizes: dict[str, int] = field(default_factory=dict)

    def schedule(self, milestones_epochs: tuple[float, ...] = (), gamma: float = 0.1) -> LRSchedule:
        return LRSchedule(
            base_lr=self.base_lr,
            peak_lr=self.lr,
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
            ("per-device batch", str(self.per_device_batch_size)),
            ("accumulation", str(self.accumulate_grad_batches)),
            ("global batch", f"{self.global_batch_size} ({self.batch_mode} mode)"),
            (
                "learning rate",
                f"{self.base_lr:g} @ {self.base_batch_size} -> {self.lr:g} @ {self.global_batch_size} "
                f"({self.scaling_rule})",
            ),
            ("warmup / total steps", f"{self.warmup_steps} / {self.total_steps} ({self.decay} decay)"),
            ("steps per epoch", str(self.steps_per_epoch)),
            ("SyncBatchNorm", "on" if self.sync_batchnorm else "off"),
            ("precision / strategy", f"{self.precision} / {self.strategy}"),
            ("seed", str(self.seed)),
            ("data", sizes),
        ]


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


def build_plan(
    *,
    topology: Topology,
    trainer_cfg: dict[str, Any],
    data_cfg: dict[str, Any],
    lr_cfg: dict[str, Any],
    base_lr: float,
    seed: int,
    dataset_sizes: dict[str, int],
    has_batchnorm: bool,
    strategy: str,
) -> Plan:
    accumulation = int(trainer_cfg.get("accumulate_grad_batches", 1))
    if accumulation < 1:
        raise UserError(f"trainer.accumulate_grad_batches={accumulation} must be at least 1")
    batch = resolve_batch(
        data_cfg.get("global_batch_size"),
        data_cfg.get("per_device_batch_size"),
        topology.world_size,
        accumulation,
    )
    train_size = dataset_sizes["train"]
    steps_per_epoch = train_size // batch.global_
    if steps_per_epoch == 0:
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

    rule = str(lr_cfg.get("rule", "linear"))
    base_batch = int(lr_cfg.get("base_batch_size", batch.global_))
    peak = scaled_lr(base_lr, batch.global_, base_batch, rule)
    decay = str(lr_cfg.get("decay", "none"))
    if decay not in DECAYS:
        raise UserError(f"callbacks.lr_scaling.decay={decay} is not one of {', '.join(DECAYS)}")
    warmup_epochs, warmup_steps = lr_cfg.get("warmup_epochs"), lr_cfg.get("warmup_steps")
    if warmup_epochs and warmup_steps:
        raise UserError(
            "set callbacks.lr_scaling.warmup_epochs or callbacks.lr_scaling.warmup_steps, not both "
            f"(got {warmup_epochs} epochs and {warmup_steps} steps)"
        )
    warmup = int(warmup_steps) if warmup_steps else round(float(warmup_epochs or 0) * steps_per_epoch)

    return Plan(
        world_size=topology.world_size,
        num_nodes=topology.num_nodes,
        devices=topology.devices,
        accelerator=topology.accelerator,
        per_device_batch_size=batch.per_device,
        accumulate_grad_batches=accumulation,
        global_batch_size=batch.global_,
        batch_mode="global" if data_cfg.get("global_batch_size") is not None else "per_device",
        base_lr=float(base_lr),
        base_batch_size=base_batch,
        scaling_rule=rule,
        lr=peak,
        warmup_steps=warmup,
        decay=decay,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps(steps_per_epoch, trainer_cfg.get("max_epochs"), trainer_cfg.get("max_steps")),
        sync_batchnorm=resolve_sync_batchnorm(trainer_cfg.get("sync_batchnorm", "auto"), topology, has_batchnorm),
        precision=str(trainer_cfg.get("precision", "32-true")),
        strategy=strategy,
        seed=int(seed),
        dataset_sizes=dict(dataset_sizes),
    )


def resolve_sync_batchnorm(setting: Any, topology: Topology, has_batchnorm: bool) -> bool:
    """SyncBN wherever it can run (GPU, more than one process); torch refuses it on CPU."""
    if setting in ("auto", None):
        return has_batchnorm and topology.accelerator == "gpu" and topology.world_size > 1
    if setting and topology.accelerator == "cpu" and topology.world_size > 1:
        raise UserError(
            "trainer.sync_batchnorm=true cannot run on CPU (torch's SyncBatchNorm needs GPUs); "
            "use trainer.sync_batchnorm=auto, or model.net.norm=group for batch-independent normalisation"
        )
    return bool(setting)
