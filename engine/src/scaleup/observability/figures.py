"""Test-time figures for classifiers: a confusion matrix and a grid of misclassified samples, as logger images.

A callback that a classifier returns from its `configure_callbacks()` (ImageClassifier does, set by `model.figures`),
so tasks that are not image classification simply do not have it.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import numpy as np
import torch
from torchmetrics.classification import MulticlassConfusionMatrix

from scaleup.observability.loggers import log_image, takes_images


class ClassificationFigures(L.Callback):
    """After the test: `test/confusion_matrix` over the whole test split (counts summed over all processes by
    torchmetrics, exact like the other test metrics), and `test/misclassified`, up to `max_samples` test images
    the model got wrong (from rank 0's share of the split), titled `true -> predicted`.

    The logits come from a forward hook on the LightningModule (its `forward` must return them), so nothing
    is computed twice; batches other than (images, labels), such as dicts, draw no figure. Above `max_classes`
    classes the matrix is skipped: unreadable as an image, and gathering it from every process would cost memory
    (1000 classes are 8 MB per process). A run without a logger that takes images (`logger=none`, CSV) draws
    nothing: matplotlib's drawing takes about a second per test.
    """

    def __init__(self, max_samples: int = 16, max_classes: int = 50) -> None:
        self.max_samples, self.max_classes = max_samples, max_classes
        self._logits: torch.Tensor | None = None
        self._hook: Any = None
        self._confusion: MulticlassConfusionMatrix | None = None
        self._wrong: list[tuple[torch.Tensor, int, int]] = []

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._confusion, self._wrong = None, []
        if takes_images(trainer):  # else no logits are kept, no batch is looked at, nothing is gathered or drawn
            self._hook = pl_module.register_forward_hook(self._keep_logits)

    def _keep_logits(self, module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        self._logits = output

    def on_test_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not (isinstance(batch, tuple | list) and len(batch) == 2 and isinstance(self._logits, torch.Tensor)):
            return  # figures of (images, labels) batches and logits only: a dict batch draws none
        x, y = batch
        preds = self._logits.detach().argmax(-1)
        num_classes = self._logits.shape[-1]
        if self._confusion is None and num_classes <= self.max_classes:
            self._confusion = MulticlassConfusionMatrix(num_classes).to(pl_module.device)
        if self._confusion is not None:
            self._confusion.update(preds, y)
        if trainer.is_global_zero and len(self._wrong) < self.max_samples:
            for i in (preds != y).nonzero().flatten()[: self.max_samples - len(self._wrong)].tolist():
                self._wrong.append((x[i].detach().float().cpu(), int(y[i]), int(preds[i])))

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # compute() gathers the counts from every process: all of them call it.
        matrix = self._confusion.compute().cpu() if self._confusion is not None else None
        if not trainer.is_global_zero:
            return
        if matrix is not None:
            log_image(trainer, "test/confusion_matrix", confusion_matrix_image(matrix))
        if self._wrong:
            log_image(trainer, "test/misclassified", samples_image(self._wrong))

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._hook is not None:
            self._hook.remove()
        self._logits = self._confusion = self._hook = None
        self._wrong = []


def render(figure: Any) -> np.ndarray:
    """A matplotlib figure as an RGB uint8 array (height, width, 3), drawn off-screen."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def confusion_matrix_image(matrix: torch.Tensor) -> np.ndarray:
    """Rows: true class, columns: predicted class; the counts written in the cells up to 20 classes."""
    from matplotlib.figure import Figure

    n = matrix.shape[0]
    size = min(12.0, 2.5 + 0.45 * n)
    figure = Figure(figsize=(size, size), dpi=100)
    ax = figure.add_subplot()
    ax.imshow(matrix.numpy(), cmap="Blues")
    ax.set(xlabel="predicted", ylabel="true", title=f"test confusion matrix ({int(matrix.sum())} samples)")
    if n <= 20:
        ax.set(xticks=range(n), yticks=range(n))
        threshold = matrix.max().item() / 2
        for (true, pred), count in np.ndenumerate(matrix.numpy()):
            color = "white" if count > threshold else "black"
            ax.text(pred, true, str(count), ha="center", va="center", color=color, fontsize=8)
    figure.tight_layout()
    return render(figure)


def samples_image(samples: list[tuple[torch.Tensor, int, int]]) -> np.ndarray:
    """Input images (channels first, any normalisation: each is rescaled to [0, 1]) titled `true -> predicted`."""
    from matplotlib.figure import Figure

    cols = min(len(samples), 8)
    rows = math.ceil(len(samples) / cols)
    figure = Figure(figsize=(1.5 * cols, 1.7 * rows), dpi=100)
    for k, (image, true, pred) in enumerate(samples):
        ax = figure.add_subplot(rows, cols, k + 1)
        image = (image - image.min()) / (image.max() - image.min()).clamp_min(1e-12)
        pixels = image[0] if image.shape[0] == 1 else image.permute(1, 2, 0)
        ax.imshow(pixels.numpy(), cmap="gray" if image.shape[0] == 1 else None)
        ax.set_title(f"{true} -> {pred}", fontsize=9)
        ax.axis("off")
    figure.tight_layout()
    return render(figure)
