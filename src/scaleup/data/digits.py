"""scikit-learn's bundled handwritten digits: 1,797 real 8x8 images, no download."""

from typing import Annotated

import torch
from pydantic import Field
from sklearn.datasets import load_digits
from torch.utils.data import Dataset, TensorDataset

from scaleup.data.classification import ClassificationDataModule
from scaleup.engine.datamodule import random_split_indices, split_lengths

SIZE = 1797  # samples in scikit-learn's digits


class DigitsDataModule(ClassificationDataModule):
    num_classes = 10
    in_channels = 1
    in_memory = True

    def __init__(
        self,
        val_size: Annotated[float, Field(ge=0)] = 180,  # a count, or a fraction (< 1) of the data set
        test_size: Annotated[float, Field(ge=0)] = 360,
        split_seed: int = 0,
        **loader_kwargs,
    ) -> None:
        super().__init__(**loader_kwargs)
        self.val_size, self.test_size, self.split_seed = val_size, test_size, split_seed

    def known_split_sizes(self) -> dict[str, int]:
        return dict(zip(("train", "val", "test"), split_lengths(SIZE, self.val_size, self.test_size), strict=True))

    def build_splits(self) -> dict[str, Dataset]:
        images, labels = load_digits(return_X_y=True)
        x = torch.tensor(images, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
        x = (x - 0.3) / 0.4  # roughly zero mean, unit variance over the data set
        y = torch.tensor(labels, dtype=torch.long)
        lengths = split_lengths(len(y), self.val_size, self.test_size)
        parts = random_split_indices(len(y), lengths, self.split_seed)
        return {name: TensorDataset(x[idx], y[idx]) for name, idx in zip(("train", "val", "test"), parts, strict=True)}
