"""Speed settings that change no result worth keeping float32 for: TF32 tensor cores and channels_last."""

from __future__ import annotations

import lightning as L
import torch


def set_tf32(enabled: bool) -> None:
    """TF32 for float32 matmuls and cuDNN convolutions (Ampere and newer GPUs; no effect elsewhere).

    TF32 keeps float32's range with a 10-bit mantissa, the same as float16's: fine for training, and about 8x the
    float32 matmul throughput of an A100. Off means full float32 everywhere, convolutions included (cuDNN allows TF32 by
    default, matmuls do not).
    """
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled


def apply_speed_settings(trainer: L.Trainer, module: L.LightningModule, tf32: bool, channels_last: bool) -> None:
    """`performance.tf32` and `performance.channels_last`, in a process that trains or evaluates (StepPlan's `setup`,
    in callbacks/step_plan.py: every process, including those `ddp_spawn` starts, which inherit no global torch
    settings from the parent).

    channels_last converts the network's 4-d weights to NHWC before DDP wraps the module; a convolution with NHWC
    weights computes in NHWC whatever the input's layout. The data module is told too
    (`GlobalBatchDataModule.channels_last`): the image batches it normalises on the device are laid out NHWC, so the
    first convolution reads them without a copy.
    """
    set_tf32(tf32)
    if trainer.datamodule is not None:
        trainer.datamodule.channels_last = channels_last
    if channels_last:
        module.to(memory_format=torch.channels_last)
