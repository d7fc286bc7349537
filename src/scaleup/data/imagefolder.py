"""Any `root/{train,val}/<class>/<image>` tree (the ImageNet layout), with the standard ImageNet transforms."""

from pathlib import Path

from torch.utils.data import Dataset
from torchvision import transforms as T
from torchvision.datasets import ImageFolder

from scaleup.engine.datamodule import GlobalBatchDataModule
from scaleup.engine.errors import UserError

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class ImageFolderDataModule(GlobalBatchDataModule):
    """`test` is `root/test` when it exists, else `root/val` (as for ImageNet, whose test labels are private)."""

    def __init__(self, root: str, image_size: int = 224, **loader_kwargs) -> None:
        super().__init__(**loader_kwargs)
        self.root, self.image_size = Path(root), image_size
        self.classes = self._classes("train")
        self.num_classes = len(self.classes)

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

    def build_splits(self) -> dict[str, Dataset]:
        size = self.image_size
        normalize = T.Normalize(IMAGENET_MEAN, IMAGENET_STD)
        train_tf = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
        # Resize to size/0.875 then centre-crop: 256 -> 224 for ImageNet.
        eval_tf = T.Compose([T.Resize(round(size / 0.875)), T.CenterCrop(size), T.ToTensor(), normalize])
        test_split = "test" if (self.root / "test").is_dir() else "val"
        for split in ("val", test_split):
            if self._classes(split) != self.classes:
                raise UserError(f"{self.root}/{split} and {self.root}/train have different class directories")
        return {
            "train": ImageFolder(self._dir("train"), train_tf),
            "val": ImageFolder(self._dir("val"), eval_tf),
            "test": ImageFolder(self._dir(test_split), eval_tf),
        }
