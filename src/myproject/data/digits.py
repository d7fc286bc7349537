"""scikit-learn's bundled handwritten digits: 1,797 real 8x8 images, no download."""

from typing import Any

import torch
from sklearn.datasets import load_digits
from torch.utils.data import Dataset, TensorDataset

from scaleup.api import ClassificationDataModule, random_split_indices, split_lengths

SIZE = 1797  # samples in scikit-learn's digits
MEAN, STD = 0.3, 0.4  # of the pixels scaled to [0, 1], roughly, over the data set
BACKGROUND = (0.0 - MEAN) / STD  # a blank pixel, normalised: what shifted-in borders are filled with


class Augmented(Dataset):
    """(image, label) pairs with a random transform applied to the image each time it is loaded."""

    def __init__(self, data: Dataset, transform: Any) -> None:
        self.data, self.transform = data, transform

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, label = self.data[index]
        return self.transform(image), label


def random_shift_and_rotation() -> Any:
    """Shifts of up to one pixel and rotations of up to 10 degrees (no flips: a flipped 2 is no digit).

    torchvision's transforms draw from torch's global generator, which the template seeds per sample from
    (seed, epoch, index) (data/seeding.py SeededSamples): the same transform on any device or worker count.
    """
    from torchvision.transforms import v2  # only when augmenting: torchvision's import takes a while

    return v2.RandomAffine(degrees=10, translate=(1 / 8, 1 / 8), fill=BACKGROUND)


class DigitsDataModule(ClassificationDataModule):
    num_classes = 10
    in_channels = 1
    in_memory = True

    def __init__(
        self,
        val_size: float = 180,  # a count, or a fraction (< 1) of the data set
        test_size: float = 360,
        split_seed: int = 0,
        augment: bool = False,  # random shifts and rotations of the training images
        **loader_kwargs,
    ) -> None:
        super().__init__(**loader_kwargs)
        self.val_size, self.test_size, self.split_seed, self.augment = val_size, test_size, split_seed, augment

    def draws_random_numbers(self, split: str) -> bool:
        return self.augment and split == "train"

    def known_split_sizes(self) -> dict[str, int]:
        return dict(zip(("train", "val", "test"), split_lengths(SIZE, self.val_size, self.test_size), strict=True))

    def build_splits(self) -> dict[str, Dataset]:
        images, labels = load_digits(return_X_y=True)
        x = torch.tensor(images, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
        x = (x - MEAN) / STD
        y = torch.tensor(labels, dtype=torch.long)
        lengths = split_lengths(len(y), self.val_size, self.test_size)
        parts = random_split_indices(len(y), lengths, self.split_seed)
        splits = {
            name: TensorDataset(x[idx], y[idx]) for name, idx in zip(("train", "val", "test"), parts, strict=True)
        }
        if self.augment:  # training only: evaluation sees the images as they are
            splits["train"] = Augmented(splits["train"], random_shift_and_rotation())
        return splits
