"""Start-up checks for the single-to-multi-device pitfalls that cannot be fixed automatically."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from scaleup.errors import UserError
from scaleup.plan.resolve import SMALL_BN_BATCH, Plan, unfrozen_batchnorm

if TYPE_CHECKING:
    from scaleup.config.schema import Strategy
    from scaleup.config.typed import TrainConfig
    from scaleup.data.datamodule import GlobalBatchDataModule


# Every BatchNorm torch has (the layers that compute statistics over the micro-batch)
BATCH_NORMS = (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d,
    nn.SyncBatchNorm,
)  # fmt: skip


def has_batchnorm(module: nn.Module) -> bool:
    return any(isinstance(m, BATCH_NORMS) for m in module.modules())


def check_config(config: TrainConfig, plan: Plan) -> None:
    """Mistakes that would crash later or silently change results: refuse them now."""
    if plan.strategy == "fsdp":
        check_fsdp_options(config.strategy, plan)
        if config.model.get("compile"):
            # Measured (torch 2.14): dynamo meets FSDP2's hooks, which it skips (`torch._dynamo.disable`), at every
            # unit, and breaks the graph there; a network compiled as a whole before sharding compiled no graph.
            raise UserError(
                "model.compile=true with strategy=fsdp: torch.compile stops at the hooks FSDP puts on every unit, so "
                "the network would run uncompiled. Train it compiled with strategy=ddp, or without compile under fsdp"
            )
    if plan.accelerator == "cpu" and plan.precision.startswith("16"):
        raise UserError(
            f"trainer.precision={plan.precision} needs a GPU; on CPU use trainer.precision=bf16-mixed or 32-true"
        )


def check_fsdp_options(strategy: Strategy, plan: Plan) -> None:
    """FSDP's GPU options where they cannot do what they say."""
    if strategy.cpu_offload and plan.accelerator == "cpu":
        raise UserError(
            "strategy.cpu_offload=true moves the shards off the GPU into host memory; on CPU they are there"
        )
    if strategy.mixed_precision and plan.precision != "32-true":
        raise UserError(
            f"strategy.mixed_precision={strategy.mixed_precision} is FSDP's own mixed precision (float32 master "
            f"weights and gradient reduction); with it pass trainer.precision=32-true, not {plan.precision}"
        )


def pitfall_warnings(
    plan: Plan, *, has_batchnorm: bool, num_workers: int, data_in_memory: bool, norm_key: str | None = None
) -> list[str]:
    """Settings that run but probably do not do what the user wants. `norm_key`: the model's setting that swaps
    BatchNorm for a norm without batch statistics, where it has one (the example's `model.net.norm`)."""
    warnings = []
    if plan.scaling_rule == "none" and plan.global_batch_size != plan.base_batch_size:
        lrs = "each param group's LR" if plan.base_lr is None else f"the LR {plan.base_lr:g}"
        warnings.append(
            f"lr_schedule.rule=none: {lrs} tuned for a batch of {plan.base_batch_size} "
            f"is used unchanged with a global batch of {plan.global_batch_size}; use rule=linear or sqrt"
        )
    if plan.total_steps is not None and plan.warmup_steps is not None and plan.warmup_steps > plan.total_steps:
        warnings.append(
            f"the warmup ({plan.warmup_steps} steps) is longer than the run ({plan.total_steps} steps): the LR never "
            "reaches its peak; lower lr_schedule.warmup_epochs or warmup_steps"
        )
    if has_batchnorm and (warning := batchnorm_warning(plan, norm_key)):
        warnings.append(warning)
    if has_batchnorm and (warning := finetune_batchnorm_warning(plan)):
        warnings.append(warning)
    if num_workers == 0 and plan.accelerator == "gpu" and plan.world_size > 1 and not data_in_memory:
        warnings.append(
            "data.num_workers=0 on a multi-GPU run: every process loads and decodes its data in the training "
            "loop, and the slowest one holds up all the others at each gradient sync; set data.num_workers=4 or more"
        )
    return warnings


def finetune_batchnorm_warning(plan: Plan) -> str | None:
    """Pretrained BatchNorm statistics (init.weights) updated with another number of samples per statistic than
    they were trained with: the running statistics drift from the ones the weights expect."""
    trained, bn = plan.trained_bn_batch_size, plan.bn_batch_size
    if trained is None or bn is None or bn == trained:
        return None
    if bn > trained:
        fix = f"data.max_per_device_batch_size={trained} (the rest accumulated)"
    else:
        fix = f"{trained} samples per device (a larger global batch, or fewer devices)"
        if plan.accelerator == "gpu" and plan.world_size > 1 and not plan.sync_batchnorm:
            fix += ", trainer.sync_batchnorm=true"
    return (
        f"BatchNorm statistics come from {bn} samples, and the initial weights were trained with {trained} "
        f"(init.bn_batch_size): their running statistics drift from the ones the weights expect. Options: {fix}, "
        "or init.freeze_bn=true (BatchNorm in eval mode: the weights' statistics, never updated)"
    )


def batchnorm_warning(plan: Plan, norm_key: str | None = None) -> str | None:
    """BatchNorm statistics over fewer than SMALL_BN_BATCH samples, or over another number than the recipe was
    tuned with (lr_schedule.base_bn_batch_size): either changes the results, so say so, with the fixes. Under an
    init.freeze_bn that keeps some layers in eval mode, it names the others, which still compute them."""
    bn, tuned, per_device = plan.bn_batch_size, plan.base_bn_batch_size, plan.per_device_batch_size
    if bn is None or plan.batchnorm_frozen or (bn == tuned and bn >= SMALL_BN_BATCH):
        return None
    where = f" in {unfrozen_batchnorm(plan)}" if plan.batchnorm_unfrozen else ""
    if plan.sync_batchnorm:
        what = (
            f"BatchNorm statistics{where} come from {bn} samples (SyncBN over {plan.world_size} devices x {per_device})"
        )
    elif plan.world_size > 1:
        what = f"BatchNorm{where} runs unsynced on {plan.world_size} processes with {per_device} samples per device"
    else:
        what = f"BatchNorm statistics{where} come from {bn} samples (the micro-batch)"
    if plan.accumulate_grad_batches > 1:
        what += f", not the {plan.global_batch_size} of an optimizer step (accumulation normalises each micro-batch)"
    problems = [f"the recipe was tuned with {tuned}, so results will differ from it"] if bn != tuned else []
    if bn < SMALL_BN_BATCH:
        problems.append(f"below {SMALL_BN_BATCH} samples the statistics get noisy")
    fixes = []
    if not plan.sync_batchnorm and plan.accelerator == "gpu" and plan.world_size > 1 and bn < tuned:
        fixes.append(f"trainer.sync_batchnorm=true ({plan.world_size * per_device} per statistic)")
    if bn < tuned and plan.accumulate_grad_batches > 1:
        fixes.append("a larger data.max_per_device_batch_size (less accumulation)")
    share = plan.global_batch_size // plan.world_size
    if bn > tuned and not plan.sync_batchnorm and share % tuned == 0:
        fixes.append(f"data.max_per_device_batch_size={tuned}")
    if norm_key:
        fixes.append(f"{norm_key}=group (no batch statistics)")
    if not fixes:
        fixes.append("a norm without batch statistics in your network (GroupNorm, LayerNorm)")
    return f"{what}: {'; '.join(problems)}. Options: {', or '.join(fixes)}"


def own_train_loader_warning(datamodule: GlobalBatchDataModule) -> str | None:
    """A data module that builds its own train loader (overrides `train_dataloader`): its order of samples is the
    template's only if its sampler is `train_sampler()`'s GlobalBatchSampler, which nothing checks for it."""
    from scaleup.data.datamodule import GlobalBatchDataModule  # here: data/datamodule.py imports plan/

    if type(datamodule).train_dataloader is GlobalBatchDataModule.train_dataloader:
        return None
    return (
        f"{type(datamodule).__name__} builds its own train loader: unless its sampler is train_sampler()'s "
        "GlobalBatchSampler, every rank reads the whole split (Lightning adds no DistributedSampler here), so "
        "1-device and N-device runs will differ. Return map-style datasets from build_splits() and let the base "
        "class make the loader"
    )
