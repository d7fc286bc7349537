"""CIFAR-10 through torchvision, downloaded once by rank 0 of each node (Lightning's `prepare_data`)."""

from pathlib import Path
from typing import Annotated

from pydantic import Field
from torch.utils.data import Dataset, Subset
from torchvision import transforms as T
from torchvision.datasets import CIFAR10

from scaleup.data.classification import ClassificationDataModule
from scaleup.engine.datamodule import random_split_indices, split_lengths
from scaleup.engine.errors import UserError

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class CIFAR10DataModule(ClassificationDataModule):
    num_classes = 10
    TRAIN_SIZE, TEST_SIZE = 50_000, 10_000  # the data set's own splits: a dry run plans without the files

    def __init__(
        self,
        root: str,
        download: bool = True,
        val_size: Annotated[float, Field(ge=0)] = 5000,  # a count, or a fraction (< 1) of the training set
        split_seed: int = 0,
        **loader_kwargs,
    ) -> None:
        super().__init__(**loader_kwargs)
        self.root, self.download, self.val_size, self.split_seed = Path(root), download, val_size, split_seed

    def _open(self, train: bool, transform=None, download: bool = False) -> CIFAR10:
        try:
            return CIFAR10(self.root, train=train, transform=transform, download=download)
        except RuntimeError as err:  # torchvision: "Dataset not found or corrupted"
            raise UserError(
                f"CIFAR-10 is not under {self.root} ({err}). Run once with data.download=true on a machine "
                f"with internet, or copy cifar-10-batches-py/ into {self.root}, or set data.root=DIR"
            ) from None
        except OSError as err:  # no network: URLError, connection refused, DNS failure
            raise UserError(
                f"could not download CIFAR-10 into {self.root}: {err}. This machine seems offline: download "
                f"it elsewhere and copy cifar-10-batches-py/ into {self.root}, or set data.root=DIR"
            ) from None

    def known_split_sizes(self) -> dict[str, int]:
        train, val, _ = split_lengths(self.TRAIN_SIZE, self.val_size, 0)
        return {"train": train, "val": val, "test": self.TEST_SIZE}

    def prepare_data(self) -> None:
        for train in (True, False):
            self._open(train, download=self.download)

    def build_splits(self) -> dict[str, Dataset]:
        augment = T.Compose(
            [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)]
        )
        plain = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
        train_aug, train_plain = self._open(True, augment), self._open(True, plain)
        lengths = split_lengths(len(train_aug), self.val_size, 0)
        train_idx, val_idx, _ = random_split_indices(len(train_aug), lengths, self.split_seed)
        return {
            "train": Subset(train_aug, train_idx.tolist()),
            "val": Subset(train_plain, val_idx.tolist()),  # held out from train, without augmentation
            "test": self._open(False, plain),
        }
