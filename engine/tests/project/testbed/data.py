"""scikit-learn's 1,797 digits (8x8, in memory), images drawn from their index, and a tree of image files."""

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from sklearn.datasets import load_digits
from torch.utils.data import Dataset, TensorDataset
from torchvision.datasets import ImageFolder

from scaleup.api import (
    ClassificationDataModule,
    EncodedBatch,
    ImageDataModule,
    ImageFiles,
    ImageTransform,
    UserError,
    random_split_indices,
    split_lengths,
)

DIGITS = 1797
BLANK = -0.75  # a blank pixel after (x - 0.3) / 0.4: what a shift fills the border with
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def random_shift_and_rotation() -> Any:
    """Up to one pixel of shift and 10 degrees of rotation, drawn from torch's generator (seeded per sample)."""
    from torchvision.transforms import v2

    return v2.RandomAffine(degrees=10, translate=(1 / 8, 1 / 8), fill=BLANK)


class Transformed(Dataset):
    def __init__(self, data: Dataset, transform: Any) -> None:
        self.data, self.transform = data, transform

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, label = self.data[index]
        return (self.transform(image) if self.transform else image), label


class DigitsDataModule(ClassificationDataModule):
    num_classes, in_channels, in_memory = 10, 1, True

    def __init__(
        self,
        val_size: float = 180,
        test_size: float = 360,
        split_seed: int = 0,
        augment: bool = False,
        **loader_kwargs,
    ) -> None:
        super().__init__(**loader_kwargs)
        self.val_size, self.test_size, self.split_seed, self.augment = val_size, test_size, split_seed, augment

    def draws_random_numbers(self, split: str) -> bool:
        return self.augment and split == "train"

    def known_split_sizes(self) -> dict[str, int]:
        return dict(zip(("train", "val", "test"), split_lengths(DIGITS, self.val_size, self.test_size), strict=True))

    def build_splits(self) -> dict[str, Dataset]:
        pixels, labels = load_digits(return_X_y=True)
        images = (torch.tensor(pixels, dtype=torch.float32).view(-1, 1, 8, 8) / 16 - 0.3) / 0.4
        targets = torch.tensor(labels)
        parts = random_split_indices(DIGITS, split_lengths(DIGITS, self.val_size, self.test_size), self.split_seed)
        splits = {
            split: TensorDataset(images[i], targets[i])
            for split, i in zip(("train", "val", "test"), parts, strict=True)
        }
        if self.augment:
            splits["train"] = Transformed(splits["train"], random_shift_and_rotation())
        return splits


class Drawn(Dataset):
    """Sample i is class prototype + noise, drawn from (seed, offset + i) alone: the same on any rank or worker."""

    def __init__(self, size: int, shape: tuple[int, ...], num_classes: int, seed: int, offset: int) -> None:
        self.size, self.shape, self.num_classes, self.seed, self.offset = size, shape, num_classes, seed, offset
        self.prototypes = torch.randn(num_classes, shape[0], 4, 4, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        generator = torch.Generator().manual_seed((self.seed << 32) + self.offset + index)
        label = int(torch.randint(self.num_classes, (1,), generator=generator))
        prototype = torch.nn.functional.interpolate(self.prototypes[label][None], size=self.shape[1:])[0]
        return prototype + torch.randn(self.shape, generator=generator), label


class SyntheticDataModule(ClassificationDataModule):
    def __init__(
        self,
        train_size: int = 4096,
        val_size: int = 512,
        test_size: int = 512,
        image_shape: tuple[int, int, int] = (3, 32, 32),
        num_classes: int = 10,
        data_seed: int = 0,
        **loader_kwargs,
    ) -> None:
        super().__init__(**loader_kwargs)
        self.sizes = {"train": train_size, "val": val_size, "test": test_size}
        self.image_shape, self.num_classes, self.data_seed = tuple(image_shape), num_classes, data_seed
        self.in_channels = self.image_shape[0]

    def draws_random_numbers(self, split: str) -> bool:
        return False

    def known_split_sizes(self) -> dict[str, int]:
        return dict(self.sizes)

    def build_splits(self) -> dict[str, Dataset]:
        offsets = [0, self.sizes["train"], self.sizes["train"] + self.sizes["val"]]
        return {
            split: Drawn(size, self.image_shape, self.num_classes, self.data_seed, offset)
            for (split, size), offset in zip(self.sizes.items(), offsets, strict=True)
        }


class ImageTreeDataModule(ImageDataModule):
    """`root/{train,val}/<class>/<image>` through the engine's image files: decoded by torchvision.io in the loader
    workers, or (`decode_device=cuda`) left encoded for nvjpeg; batches travel as uint8. val is also the test split."""

    mean, std = IMAGENET_MEAN, IMAGENET_STD

    def __init__(
        self, root: str, image_size: int = 224, decode_device: Literal["cpu", "cuda"] = "cpu", **loader_kwargs
    ) -> None:
        super().__init__(**loader_kwargs)
        if decode_device == "cuda" and not torch.cuda.is_available():
            raise UserError("data.decode_device=cuda needs a CUDA GPU")
        self.root, self.image_size, self.decode_device = Path(root), image_size, decode_device

    @property
    def num_classes(self) -> int | None:
        return len(ImageFolder(self.root / "train").classes) if (self.root / "train").is_dir() else None

    def build_splits(self) -> dict[str, Dataset]:
        folders, encoded = {"train": "train", "val": "val", "test": "val"}, self.decode_device == "cuda"
        return {
            split: ImageFiles(ImageFolder(self.root / folder).samples, self.transform(split), encoded)
            for split, folder in folders.items()
            if (self.root / folder).is_dir()
        }

    def transform(self, split: str) -> ImageTransform:
        return ImageTransform(self.image_size, train=split == "train")

    def collate_fn(self, split: str) -> Callable[[list], Any] | None:
        return functools.partial(EncodedBatch.collate, self.transform(split)) if self.decode_device == "cuda" else None
