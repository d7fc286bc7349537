"""Encoded images to uint8 tensors: decoding (libjpeg-turbo on the CPU, nvjpeg on a GPU) and the ImageNet transforms.

The loader workers decode with `torchvision.io` and transform with `torchvision.transforms.v2` on uint8 CHW
tensors; batches travel as uint8 (a quarter of float32's bytes through the worker queues and the host-to-device
copy), and are turned into normalised floats on the device, after the transfer (`scaleup.data.image_batches`).

`ImageTransform.from_bytes(data, name)` is the whole per-sample path from a file's bytes to the uint8 tensor the
batch holds: ImageFolder calls it on each file, a sharded stream on each record. Its random draws come from torch's
global generator, which `SeededSamples` seeds per (seed, epoch, index) before each sample (docs/randomness.md).
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset
from torchvision.io import ImageReadMode, decode_image, decode_jpeg, read_file
from torchvision.transforms import RandomResizedCrop
from torchvision.transforms.v2 import functional as F

from scaleup.errors import UserError

#: RandomResizedCrop's ranges: 8% to 100% of the area, aspect ratio 3/4 to 4/3 (torchvision's defaults).
SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)
#: Evaluation resizes the shorter side to size / 0.875 and centre-crops size: 256 -> 224 for ImageNet.
EVAL_CROP_FRACTION = 0.875


class ImageDecodeError(UserError):
    """A file that is not a readable image, named in the message (one line also from a loader worker: UserError)."""


def encoded_tensor(data: torch.Tensor | bytes) -> torch.Tensor:
    """The 1-d uint8 tensor torchvision's decoders read, from a tensor or from bytes (a record of a shard)."""
    if isinstance(data, torch.Tensor):
        return data
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)  # a copy: bytes are read-only, tensors are not


def decode(data: torch.Tensor | bytes, name: str) -> torch.Tensor:
    """The RGB uint8 CHW tensor of an encoded image (JPEG, PNG, ...: its bytes, or a 1-d uint8 tensor of them),
    on the CPU. `name` (the file or record) is what the error names when the bytes are no image.
    """
    data = encoded_tensor(data)
    try:
        return decode_image(data, mode=ImageReadMode.RGB)
    except RuntimeError as err:  # torchvision's decoders raise RuntimeError for corrupt or unknown data
        # "decode_jpeg, /path/to/decode_jpeg.cpp:171, Image is incomplete or truncated": the reason alone
        reason = re.sub(r"^\w+, \S+:\d+, ", "", str(err).strip().splitlines()[0])
        if reason.startswith("Unsupported image file"):
            return pil_decode(data, name)
        raise ImageDecodeError(f"{name}: not a readable image ({reason}); remove or replace the file") from None


@contextlib.contextmanager
def pil_image(data: torch.Tensor, name: str) -> Iterator[Image.Image]:
    """The encoded image opened with PIL; what PIL cannot read is one ImageDecodeError naming `name` (PIL's own
    `cannot identify image file <_io.BytesIO object at 0x...>` said in words)."""
    try:
        with Image.open(io.BytesIO(data.numpy().tobytes())) as image:
            yield image
    except (UnidentifiedImageError, OSError) as err:
        reason = "no image format PIL or torchvision knows" if isinstance(err, UnidentifiedImageError) else str(err)
        raise ImageDecodeError(f"{name}: not a readable image ({reason}); remove or replace the file") from None


def pil_decode(data: torch.Tensor, name: str) -> torch.Tensor:
    """What torchvision.io does not decode (BMP, TIFF, PPM: ImageFolder's other extensions), through PIL."""
    with pil_image(data, name) as image:
        pixels = torch.from_numpy(np.array(image.convert("RGB")))
    return pixels.permute(2, 0, 1)  # HWC -> CHW, as torchvision's decoders return it


def image_size(data: torch.Tensor, name: str) -> tuple[int, int]:
    """(height, width) of an encoded JPEG from its header alone, for augmentation drawn before a GPU decodes it."""
    with pil_image(data, name) as image:
        kind, (width, height) = image.format, image.size
    if kind != "JPEG":
        raise ImageDecodeError(
            f"{name}: a {kind} image, and data.decode_device=cuda decodes JPEGs only: convert it, or use "
            "data.decode_device=cpu"
        )
    return height, width


class ImageTransform:
    """The standard ImageNet transforms on uint8 CHW tensors, in two halves: `draw` the random parameters of a
    sample (from torch's global generator, in the loader worker, where the sample is seeded), and `apply` them
    on the CPU or on a GPU. Calling it does both.

    Training: RandomResizedCrop(size) and a horizontal flip with probability 1/2. Evaluation: resize the shorter
    side to round(size / 0.875), centre-crop size x size; nothing random. Resizing is bilinear with antialiasing,
    as torchvision's (and PIL's) defaults.
    """

    def __init__(self, size: int, train: bool) -> None:
        self.size, self.train = size, train

    def draw(self, height: int, width: int) -> tuple[int, ...]:
        """(top, left, height, width, flip) of the crop for training; () for evaluation."""
        if not self.train:
            return ()
        # torchvision's own sampling of the crop box; it reads only the image's shape, so a zero-stride stand-in.
        shape = torch.zeros(()).expand(1, height, width)
        top, left, crop_h, crop_w = RandomResizedCrop.get_params(shape, list(SCALE), list(RATIO))
        flip = int(torch.rand(1) < 0.5)  # as RandomHorizontalFlip draws it
        return top, left, crop_h, crop_w, flip

    def apply(self, image: torch.Tensor, params: Sequence[int]) -> torch.Tensor:
        """The size x size uint8 tensor for `image` (uint8 CHW, on any device) under the drawn `params`."""
        if not self.train:
            image = F.resize(image, [round(self.size / EVAL_CROP_FRACTION)], antialias=True)
            return F.center_crop(image, [self.size, self.size])
        top, left, crop_h, crop_w, flip = params
        image = F.resized_crop(image, top, left, crop_h, crop_w, [self.size, self.size], antialias=True)
        return F.horizontal_flip(image) if flip else image

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return self.apply(image, self.draw(*image.shape[-2:]))

    def from_bytes(self, data: torch.Tensor | bytes, name: str) -> torch.Tensor:
        """Decode an encoded image (its bytes, or a 1-d uint8 tensor of them) and transform it: the uint8 sample."""
        return self(decode(data, name))


class EncodedBatch:
    """A batch of still-encoded JPEGs with their drawn transform parameters, for decoding on a GPU (nvjpeg).

    Built by `collate` in the loader workers (`data.decode_device=cuda`); `decode` runs in the training process
    before the transfer, since torchvision's GPU decoder reads the bytes from host memory.
    """

    def __init__(
        self, data: list[torch.Tensor], params: list[tuple[int, ...]], labels: torch.Tensor, transform: ImageTransform
    ) -> None:
        self.data, self.params, self.labels, self.transform = data, params, labels, transform

    @staticmethod
    def sample(
        transform: ImageTransform, data: torch.Tensor | bytes, name: str
    ) -> tuple[torch.Tensor, tuple[int, ...]]:
        """One sample's share of the work in the worker: the bytes as they are, and the parameters drawn."""
        data = encoded_tensor(data)
        return data, transform.draw(*image_size(data, name))

    @classmethod
    def collate(cls, transform: ImageTransform, samples: list) -> EncodedBatch:
        """DataLoader collate_fn for samples `((data, params), label)`."""
        return cls(
            [data for (data, _), _ in samples],
            [params for (_, params), _ in samples],
            torch.tensor([label for _, label in samples]),
            transform,
        )

    def decode(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(uint8 images on `device`, labels still on the host): decoded in one nvjpeg call, then transformed."""
        if device.type != "cuda":
            raise UserError(f"data.decode_device=cuda decodes on a CUDA GPU, and this run trains on {device}")
        images = decode_jpeg(self.data, mode=ImageReadMode.RGB, device=device)
        out = [self.transform.apply(image, params) for image, params in zip(images, self.params, strict=True)]
        return torch.stack(out), self.labels


class ImageFiles(Dataset):
    """(uint8 CHW image, label) for each (path, label) of an ImageFolder scan, decoded with torchvision.io.

    With `encoded=True` a sample is `((bytes, drawn transform parameters), label)` instead, for a GPU to decode
    (`EncodedBatch`).
    """

    def __init__(self, samples: list[tuple[str, int]], transform: ImageTransform, encoded: bool = False) -> None:
        self.samples, self.transform, self.encoded = samples, transform, encoded

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        path, label = self.samples[index]
        data = read_file(path)
        if self.encoded:
            return EncodedBatch.sample(self.transform, data, path), label
        return self.transform.from_bytes(data, path), label
