from myproject.data.cifar10 import CIFAR10DataModule
from myproject.data.digits import DigitsDataModule
from myproject.data.imagefolder import ImageFolderDataModule
from myproject.data.synthetic import SyntheticDataModule
from myproject.data.text import CharTextDataModule

__all__ = [
    "CIFAR10DataModule",
    "CharTextDataModule",
    "DigitsDataModule",
    "ImageFolderDataModule",
    "SyntheticDataModule",
]
