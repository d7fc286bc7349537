"""Image data sets whose batches travel as uint8 and become normalised floats on the device, after the transfer."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from scaleup.data.classification import ClassificationDataModule
from scaleup.data.images import EncodedBatch


def normalize(
    images: torch.Tensor, mean: Sequence[float], std: Sequence[float], channels_last: bool = False
) -> torch.Tensor:
    """float32 (images / 255 - mean) / std of a uint8 NCHW batch, per channel, where `images` lies.

    The same operations, in the same order, as torchvision's ToTensor and Normalize on each image. With
    `channels_last` the result is stored NHWC, the layout of channels_last convolution weights, so the first
    convolution reads it without a copy.
    """
    layout = torch.channels_last if channels_last and images.dim() == 4 else torch.contiguous_format
    x = images.to(torch.float32, memory_format=layout)
    mean_t, std_t = channel_statistics(tuple(mean), tuple(std), x.device)
    return x.div_(255).sub_(mean_t).div_(std_t)


@functools.cache
def channel_statistics(
    mean: tuple[float, ...], std: tuple[float, ...], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """mean and std as (C, 1, 1) float32 tensors on `device`, copied there once, not at every step."""
    return tuple(torch.tensor(v, dtype=torch.float32, device=device).view(-1, 1, 1) for v in (mean, std))


class ImageDataModule(ClassificationDataModule):
    """An image data set whose splits yield `(uint8 CHW image, label)`: the loaders move uint8 batches, and the
    Lightning hook `on_after_batch_transfer` normalises them on the device with the subclass's `mean` and `std`
    (per channel, of the pixels scaled to [0, 1]), in NHWC under `performance.channels_last=true`, then casts them
    as the precision wants (float64 for `64-true`). The network sees what ToTensor + Normalize gave it before.

    A batch still encoded (`EncodedBatch`, `data.decode_device=cuda`) is decoded on the GPU first, in
    `on_before_batch_transfer`. Outside a Trainer (a notebook), `on_after_batch_transfer(batch, 0)` normalises a
    batch taken from a loader.
    """

    mean: Sequence[float]
    std: Sequence[float]

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if isinstance(batch, EncodedBatch):
            return batch.decode(self.trainer.strategy.root_device)
        return batch

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return normalized_batch(batch, self.mean, self.std, self.trainer, self.channels_last)


def normalized_batch(
    batch: Any, mean: Sequence[float], std: Sequence[float], trainer: Any, channels_last: bool
) -> tuple[Any, ...]:
    """`(images, *rest)` with the uint8 images normalised where they lie (`normalize`), in NHWC with
    `channels_last` (the plan's), then cast for the Trainer's precision (none without a Trainer)."""
    images, *rest = batch
    x = normalize(images, mean, std, channels_last)
    if trainer is not None:
        # Lightning casts inputs for the precision before the transfer, when they were still uint8.
        x = trainer.precision_plugin.convert_input(x)
    return (x, *rest)
