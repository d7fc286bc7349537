"""CIFAR-10 through torchvision, downloaded once by rank 0 of each node (Lightning's `prepare_data`)."""

from pathlib import Path

import torch
from torch.utils.data import Dataset, Subset
from torchvision.datasets import CIFAR10
from torchvision.transforms import v2

from scaleup.api import ImageDataModule, UserError, random_split_indices, split_lengths

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class UInt8Images(Dataset):
    """(uint8 CHW image, label) pairs from images held in memory as one uint8 NHWC array, optionally transformed
    (transforms.v2 on uint8, drawing from torch's global generator)."""

    def __init__(self, images, labels: list[int], transform=None) -> None:
        self.images = torch.from_numpy(images).permute(0, 3, 1, 2)  # a view: no copy of the array
        self.labels, self.transform = labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index]
        return (self.transform(image) if self.transform else image), self.labels[index]


class CIFAR10DataModule(ImageDataModule):
    """Batches travel as uint8 and are normalised on the device (`ImageDataModule`)."""

    num_classes = 10
    mean, std = MEAN, STD
    TRAIN_SIZE, TEST_SIZE = 50_000, 10_000  # the data set's own splits: a dry run plans without the files

    def __init__(
        self,
        root: str,
        download: bool = True,
        val_size: float = 5000,  # a count, or a fraction (< 1) of the training set
        split_seed: int = 0,
        **loader_kwargs,
    ) -> None:
        super().__init__(**loader_kwargs)
        self.root, self.download, self.val_size, self.split_seed = Path(root), download, val_size, split_seed

    def _open(self, train: bool, download: bool = False) -> CIFAR10:
        try:
            return CIFAR10(self.root, train=train, download=download)
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
        augment = v2.Compose([v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip()])
        train, test = self._open(True), self._open(False)
        lengths = split_lengths(len(train), self.val_size, 0)
        train_idx, val_idx, _ = random_split_indices(len(train), lengths, self.split_seed)
        return {
            "train": Subset(UInt8Images(train.data, train.targets, augment), train_idx.tolist()),
            # held out from train, without augmentation
            "val": Subset(UInt8Images(train.data, train.targets), val_idx.tolist()),
            "test": UInt8Images(test.data, test.targets),
        }
