from scaleup.data.cifar10 import CIFAR10DataModule
from scaleup.data.digits import DigitsDataModule
from scaleup.data.imagefolder import ImageFolderDataModule
from scaleup.data.sharded import ShardedDataModule
from scaleup.data.synthetic import SyntheticDataModule
from scaleup.data.text import CharTextDataModule

__all__ = [
    "CIFAR10DataModule",
    "CharTextDataModule",
    "DigitsDataModule",
    "ImageFolderDataModule",
    "ShardedDataModule",
    "SyntheticDataModule",
]
