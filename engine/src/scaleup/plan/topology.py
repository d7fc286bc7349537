"""Where the run goes: nodes x devices on which accelerator, and the precision that hardware runs best."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from scaleup.distributed.clusters import launched_nodes
from scaleup.errors import UserError

if TYPE_CHECKING:
    from scaleup.config.schema import EvalTrainer, TrainerArgs


@dataclass(frozen=True)
class Topology:
    accelerator: str  # "cpu" or "gpu"
    devices: int  # per node
    num_nodes: int

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes


def resolve_topology(trainer: TrainerArgs | EvalTrainer, *, dry_run: bool = False) -> Topology:
    """Turn `trainer.accelerator/devices/num_nodes` into numbers, and refuse what this machine cannot run."""
    accelerator = str(trainer.accelerator)
    if accelerator in ("cuda", "gpu"):
        accelerator = "gpu"
    elif accelerator == "auto":
        # A dry run plans for the cluster, not for the laptop it runs on.
        accelerator = "gpu" if dry_run or torch.cuda.is_available() else "cpu"
    elif accelerator != "cpu":
        raise UserError(f"trainer.accelerator={accelerator} is not supported here; use auto, gpu or cpu")

    devices = trainer.devices
    if isinstance(devices, str) and devices not in ("auto", "-1"):
        devices = [d for d in devices.split(",") if d.strip()]
    if isinstance(devices, list | tuple):
        devices = len(devices)
    elif devices in ("auto", "-1", -1):
        devices = torch.cuda.device_count() if accelerator == "gpu" and not dry_run else 1
    devices = int(devices)
    num_nodes = trainer.num_nodes
    # auto: as many nodes as the launcher started, e.g. an elastic torchrun job's after it lost one.
    num_nodes = launched_nodes() if num_nodes == "auto" else int(num_nodes)
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
