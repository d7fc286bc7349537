"""Start-up checks for the single-to-multi-device pitfalls that cannot be fixed automatically."""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
from torch.utils.data import IterableDataset

from scaleup.engine.errors import UserError
from scaleup.engine.plan import Plan

log = logging.getLogger(__name__)

SMALL_BN_BATCH = 32


def check_config(cfg: dict[str, Any], plan: Plan) -> None:
    """Mistakes that would crash later or silently change results: refuse them now."""
    if "shuffle" in cfg["data"]:
        raise UserError(
            "remove data.shuffle: the training sampler shuffles every epoch by itself (and a DataLoader "
            "refuses shuffle=True together with a sampler)"
        )
    if plan.accelerator == "cpu" and "FSDP" in plan.strategy:
        raise UserError(
            "trainer=fsdp needs GPUs (Lightning runs FSDP on CUDA only); on CPU use the default DDP strategy"
        )
    if plan.accelerator == "cpu" and plan.precision.startswith("16"):
        raise UserError(
            f"trainer.precision={plan.precision} needs a GPU; on CPU use trainer.precision=bf16-mixed or 32-true"
        )


def pitfall_warnings(plan: Plan, *, has_batchnorm: bool, num_workers: int, data_in_memory: bool) -> list[str]:
    """Settings that run but probably do not do what the user wants."""
    warnings = []
    if plan.scaling_rule == "none" and plan.global_batch_size != plan.base_batch_size:
        warnings.append(
            f"callbacks.lr_scaling.rule=none: the LR {plan.base_lr:g} tuned for a batch of {plan.base_batch_size} "
            f"is used unchanged with a global batch of {plan.global_batch_size}; use rule=linear or sqrt"
        )
    if plan.warmup_steps > plan.total_steps:
        warnings.append(
            f"the warmup ({plan.warmup_steps} steps) is longer than the run ({plan.total_steps} steps): the LR never "
            "reaches its peak; lower callbacks.lr_scaling.warmup_epochs or warmup_steps"
        )
    if (
        has_batchnorm
        and plan.world_size > 1
        and not plan.sync_batchnorm
        and plan.per_device_batch_size < SMALL_BN_BATCH
    ):
        warnings.append(
            f"BatchNorm runs unsynced on {plan.world_size} processes with {plan.per_device_batch_size} samples per "
            f"device: its statistics come from each small per-device batch, not the global one. Use SyncBatchNorm "
            f"(trainer.sync_batchnorm=auto on GPUs) or model.net.norm=group"
        )
    if num_workers == 0 and plan.accelerator == "gpu" and plan.world_size > 1 and not data_in_memory:
        warnings.append(
            "data.num_workers=0 on a multi-GPU run: every process loads and decodes its data in the training "
            "loop, and the slowest one holds up all the others at each gradient sync; set data.num_workers=4 or more"
        )
    return warnings


class TrainLoaderCheck(L.Callback):
    """Warns when a custom DataModule's train loader breaks world-size invariance or rank sharding."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from scaleup.engine.samplers import GlobalBatchSampler

        loader = trainer.train_dataloader
        if loader is None or not trainer.is_global_zero:
            return
        if isinstance(loader.dataset, IterableDataset):
            log.warning(
                "the training set is an IterableDataset: no sampler can shard it, so it must split its stream by "
                "rank and by loader worker itself (torch.utils.data.get_worker_info, trainer.global_rank), or "
                "every process trains on the same samples"
            )
        elif not isinstance(loader.sampler, GlobalBatchSampler):
            log.warning(
                f"the train loader uses {type(loader.sampler).__name__}, not GlobalBatchSampler: the order of "
                "samples will depend on the number of devices, so 1-device and N-device runs will differ"
            )
