"""Everything your code (src/<your project>/) may import from the template: this module only.

What is here keeps its name and meaning across template updates; the rest of `scaleup` is the machinery, which an
update may reorganise. It gathers the core's names and the extras' (images, figures) and sits above both: no module
of the engine imports it. docs/contract.md says what the jobs expect of your DataModule and LightningModule.

Data modules: subclass `GlobalBatchDataModule` (implement `build_splits`), or `ClassificationDataModule` to tell
the model its classes and input channels, or `ImageDataModule` for images that travel as uint8 and are normalised
on the device. Models: `StageMetrics` for exact metrics on any number of processes, `build_optimizer` for the
optimizer the LR schedule scales.
"""

from scaleup.data.classification import ClassificationDataModule
from scaleup.data.datamodule import GlobalBatchDataModule, random_split_indices, split_lengths
from scaleup.data.image_batches import ImageDataModule
from scaleup.data.images import EncodedBatch, ImageFiles, ImageTransform
from scaleup.errors import UserError
from scaleup.observability.figures import ClassificationFigures
from scaleup.observability.metrics import StageMetrics
from scaleup.optim import build_optimizer

__all__ = [
    "ClassificationDataModule",
    "ClassificationFigures",
    "EncodedBatch",
    "GlobalBatchDataModule",
    "ImageDataModule",
    "ImageFiles",
    "ImageTransform",
    "StageMetrics",
    "UserError",
    "build_optimizer",
    "random_split_indices",
    "split_lengths",
]
