"""Any `root/{train,val}/<class>/<image>` tree (the ImageNet layout), with the standard ImageNet transforms."""

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from torch.utils.data import Dataset
from torchvision.datasets import ImageFolder
from torchvision.datasets.utils import download_and_extract_archive

from scaleup.api import EncodedBatch, ImageDataModule, ImageFiles, ImageTransform, UserError

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class ImageFolderDataModule(ImageDataModule):
    """`test` is `root/test` when it exists, else `root/val` (as for ImageNet, whose test labels are private).

    Images are decoded by libjpeg-turbo (torchvision.io) in the loader workers and transformed as uint8; batches
    travel as uint8 and are normalised on the device (`ImageDataModule`). `decode_device="cuda"` leaves JPEGs
    encoded in the workers (they only draw each sample's augmentation) and decodes each batch on the GPU with
    nvjpeg, for CPUs too slow to feed it.

    With `url`, `prepare_data()` fetches that archive (.tar.gz, .tgz, .zip, ...) when `root/train` is missing and
    unpacks it beside `root`: the archive holds one folder named like `root`, as most data set archives do
    (`imagenette2-160.tgz` holds `imagenette2-160/train/...`). Its sizes are known only from the files, so a dry
    run without them plans with the steps unknown.
    """

    mean, std = IMAGENET_MEAN, IMAGENET_STD

    def __init__(
        self,
        root: str,
        image_size: int = 224,
        url: str | None = None,
        md5: str | None = None,
        decode_device: Literal["cpu", "cuda"] = "cpu",
        **loader_kwargs,
    ) -> None:
        super().__init__(**loader_kwargs)
        self.root, self.image_size, self.url, self.md5 = Path(root), image_size, url, md5
        if decode_device == "cuda" and not torch.cuda.is_available():
            raise UserError(
                "data.decode_device=cuda decodes JPEGs on a CUDA GPU, and none is visible here: "
                "pass data.decode_device=cpu"
            )
        self.decode_device = decode_device

    @property
    def num_classes(self) -> int | None:
        """The class folders under `root/train`; None until the data is there."""
        return len(self._classes("train")) if (self.root / "train").is_dir() else None

    def _dir(self, split: str) -> Path:
        path = self.root / split
        if not path.is_dir():
            raise UserError(
                f"no {split}/ directory under data.root={self.root}: expected {self.root}/{split}/<class>/<image>"
            )
        return path

    def _classes(self, split: str) -> list[str]:
        classes = sorted(p.name for p in self._dir(split).iterdir() if p.is_dir())
        if not classes:
            raise UserError(f"{self._dir(split)} holds no class directories")
        return classes

    def prepare_data(self) -> None:
        if self.url is None or (self.root / "train").is_dir():
            return
        try:
            download_and_extract_archive(self.url, self.root.parent, md5=self.md5, remove_finished=True)
        except RuntimeError as err:  # torchvision: "File not found or corrupted." (md5 mismatch)
            raise UserError(
                f"data.url={self.url} did not download intact ({err}); check data.url and data.md5"
            ) from None
        except OSError as err:  # no network: URLError, connection refused, DNS failure
            raise UserError(
                f"could not download data.url={self.url}: {err}. Without network, unpack the archive by hand so "
                f"that {self.root}/train/ exists"
            ) from None
        if not (self.root / "train").is_dir():
            raise UserError(
                f"data.url={self.url} unpacked into {self.root.parent} without a {self.root.name}/train/ folder: set "
                "data.root to <the folder that holds train/ and val/>"
            )

    def build_splits(self) -> dict[str, Dataset]:
        """The splits whose folders exist: all three for training, the test split alone for `eval.py`."""
        folders = {"train": "train", "val": "val", "test": "test" if (self.root / "test").is_dir() else "val"}
        present = {split: folder for split, folder in folders.items() if (self.root / folder).is_dir()}
        if not present:
            self._dir("train")  # the message that says where the files should be
        classes = {folder: self._classes(folder) for folder in present.values()}
        if len({tuple(names) for names in classes.values()}) > 1:
            raise UserError(f"the folders under {self.root} ({', '.join(classes)}) have different class directories")
        encoded = self.decode_device == "cuda"
        return {
            split: ImageFiles(ImageFolder(self.root / folder).samples, self._transform(split), encoded)
            for split, folder in present.items()
        }

    def _transform(self, split: str) -> ImageTransform:
        return ImageTransform(self.image_size, train=split == "train")

    def collate_fn(self, split: str) -> Callable[[list], Any] | None:
        if self.decode_device == "cuda":
            return functools.partial(EncodedBatch.collate, self._transform(split))
        return None
