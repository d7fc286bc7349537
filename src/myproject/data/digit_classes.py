"""Some of scikit-learn's digits as a task of their own: a source task to pretrain on, and a target task with few
labelled images to fine-tune on (configs/experiment/digits_pretrain.yaml, finetune_digits.yaml)."""

import torch
from sklearn.datasets import load_digits
from torch.utils.data import Dataset, TensorDataset

from myproject.data.digits import MEAN, STD, Augmented, DigitsDataModule, random_shift_and_rotation
from scaleup.api import random_split_indices, split_lengths


class DigitClassesDataModule(DigitsDataModule):
    """The images of the digits in `classes`, labelled 0, 1, ... in that order; the training split keeps at most
    `train_per_class` images of each class (None: all). `val_size` and `test_size` count within those classes."""

    def __init__(self, classes: list[int], train_per_class: int | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        if not classes or len(set(classes)) != len(classes) or not set(classes) <= set(range(10)):
            raise ValueError(f"classes={classes} must be distinct digits 0-9")
        self.classes, self.train_per_class = list(classes), train_per_class
        self.num_classes = len(self.classes)

    def known_split_sizes(self) -> None:
        return None  # counted from the data (bundled with scikit-learn: nothing to download)

    def build_splits(self) -> dict[str, Dataset]:
        images, labels = load_digits(return_X_y=True)
        keep = torch.isin(torch.tensor(labels), torch.tensor(self.classes))
        x = (torch.tensor(images, dtype=torch.float32)[keep].view(-1, 1, 8, 8) / 16.0 - MEAN) / STD
        y = torch.tensor([self.classes.index(label) for label in labels[keep.numpy()]])
        lengths = split_lengths(len(y), self.val_size, self.test_size)
        train, val, test = random_split_indices(len(y), lengths, self.split_seed)
        if self.train_per_class is not None:  # the first images of each class in the (random) training order
            train = torch.cat([train[y[train] == label][: self.train_per_class] for label in range(self.num_classes)])
        splits = {name: TensorDataset(x[idx], y[idx]) for name, idx in (("train", train), ("val", val), ("test", test))}
        if self.augment:
            splits["train"] = Augmented(splits["train"], random_shift_and_rotation())
        return splits
