"""What every classification data set here shares: it tells the model how many classes there are."""

from typing import Any

from scaleup.engine.datamodule import GlobalBatchDataModule


class ClassificationDataModule(GlobalBatchDataModule):
    """Subclasses set `num_classes` (a class attribute, or in `__init__` when the data decides it)."""

    num_classes: int

    def model_settings(self) -> dict[str, Any]:
        return {"net.num_classes": self.num_classes}  # the `num_classes: null` of configs/model/*.yaml
