"""What every classification data set here shares: it tells the model how many classes and input channels."""

from typing import Any

from scaleup.data.datamodule import GlobalBatchDataModule


class ClassificationDataModule(GlobalBatchDataModule):
    """Subclasses set `num_classes` and `in_channels` (class attributes, or in `__init__` when the data decides)."""

    num_classes: int
    in_channels: int = 3

    def model_settings(self) -> dict[str, Any]:
        # The `null`s of configs/model/*.yaml: any image model fits any image data set.
        return {"net.num_classes": self.num_classes, "net.in_channels": self.in_channels}
