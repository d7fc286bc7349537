"""Synthetic images of any size and count, generated on the fly: a 1.28M-sample set costs no memory."""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from scaleup.api import ClassificationDataModule


class SyntheticImages(Dataset):
    """Sample i is a function of (seed, offset + i) alone: same on every rank, worker and run.

    Each class has a coarse 4x4 prototype pattern, upsampled to the image size; a sample is its class's
    prototype plus Gaussian noise, so the task is learnable and accuracy means something.
    """

    def __init__(
        self, size: int, image_shape: Sequence[int], num_classes: int, seed: int, offset: int, noise: float
    ) -> None:
        self.size, self.image_shape, self.num_classes = size, tuple(image_shape), num_classes
        self.seed, self.offset, self.noise = seed, offset, noise
        channels = self.image_shape[0]
        generator = torch.Generator().manual_seed(seed)
        self.prototypes = torch.randn(num_classes, channels, 4, 4, generator=generator)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        generator = torch.Generator().manual_seed((self.seed << 32) + self.offset + index)
        label = int(torch.randint(self.num_classes, (1,), generator=generator))
        pattern = F.interpolate(self.prototypes[label][None], size=self.image_shape[1:], mode="nearest")[0]
        return pattern + self.noise * torch.randn(self.image_shape, generator=generator), label


class SyntheticDataModule(ClassificationDataModule):
    def __init__(
        self,
        train_size: int = 4096,
        val_size: int = 512,
        test_size: int = 512,
        image_shape: tuple[int, int, int] = (3, 32, 32),  # channels, height, width
        num_classes: int = 10,
        noise: float = 1.0,
        data_seed: int = 0,
        **loader_kwargs,
    ) -> None:
        super().__init__(**loader_kwargs)
        self.num_classes = num_classes
        self.sizes = {"train": train_size, "val": val_size, "test": test_size}
        if min(self.sizes.values()) < 0:  # the splits' index ranges would overlap
            raise ValueError(f"split sizes must be >= 0, got {self.sizes}")
        self.image_shape, self.noise, self.data_seed = tuple(image_shape), noise, data_seed
        self.in_channels = self.image_shape[0]

    def draws_random_numbers(self, split: str) -> bool:
        return False  # each sample is drawn from its own generator, seeded by its index

    def known_split_sizes(self) -> dict[str, int]:
        return dict(self.sizes)

    def build_splits(self) -> dict[str, Dataset]:
        splits, offset = {}, 0
        for name, size in self.sizes.items():
            splits[name] = SyntheticImages(size, self.image_shape, self.num_classes, self.data_seed, offset, self.noise)
            offset += size  # disjoint index ranges: no sample is in two splits
        return splits
