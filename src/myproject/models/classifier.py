"""The LightningModule: any `net` from config, a loss, an optimizer, and exact metrics per stage."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torchmetrics.classification import MulticlassAccuracy

from scaleup.api import ClassificationFigures, StageMetrics, build_optimizer


class ImageClassifier(L.LightningModule):
    """Cross-entropy classification around `net`.

    `net` is a Hydra-instantiable dict that includes `num_classes`; `figures` holds the settings of the test-time
    ClassificationFigures (None: no figures); `lr_scales` gives parameters a factor on the base LR by name, e.g.
    `{net.13: 10}` for a new head beside a pretrained network (build_optimizer). Args are plain containers (the job
    converts Hydra configs), so `save_hyperparameters` writes only dicts and numbers into checkpoints and
    `torch.load(..., weights_only=True)` can read them back.
    """

    def __init__(
        self,
        net: Mapping[str, Any],
        optimizer: Mapping[str, Any],
        label_smoothing: float = 0.0,
        compile: bool = False,
        figures: Mapping[str, Any] | None = None,
        lr_scales: Mapping[str, float] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = instantiate(dict(net))
        if compile:
            # In-place compile keeps parameter names: no `_orig_mod.` in checkpoints (torch.compile(net) adds it).
            self.net.compile()
        num_classes = net["num_classes"]
        # micro average: correct and total counts, summed over every sample of every process. Accuracy is an
        # evaluation metric here (val/acc, test/acc); training logs its exact loss: an accuracy update costs
        # 0.1-0.2 ms of Python in every step. For train/acc too, leave "acc" out of eval_only.
        accuracy = {"acc": MulticlassAccuracy(num_classes, average="micro")}
        if num_classes > 5:
            accuracy["acc5"] = MulticlassAccuracy(num_classes, top_k=5, average="micro")
        self.metrics = StageMetrics(accuracy, eval_only=list(accuracy))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean over this device's batch. DDP averages gradients over devices, which then equals the mean over
        the global batch because every device gets the same batch size (see GlobalBatchSampler). A loss divided
        by a global count instead would be scaled down by the number of devices: `python -m
        scaleup.check_equivalence` catches that."""
        return F.cross_entropy(logits, target, label_smoothing=self.hparams.label_smoothing)

    def _step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = self.loss(logits, y)
        self.metrics.update(stage, logits, y, batch_size=len(y), loss=loss)
        self.metrics.log(self, stage, prog_bar=["acc"])
        return loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # `train/loss` is the exact all-rank mean of the epoch. A per-step curve of this rank's loss would be
        # `self.log("train/loss_step", loss)` here: Lightning's `log` costs about 0.4 ms of Python in every step
        # (docs/performance.md#the-templates-own-cost-per-step).
        return self._step(batch, "train")

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return build_optimizer(self.hparams.optimizer, self, self.hparams.lr_scales)

    def configure_callbacks(self) -> list[L.Callback]:
        """Test-time figures (confusion matrix, misclassified samples), unless `figures` is None; attached to the
        test alone: in `fit` Lightning would call its hooks at every step for nothing."""
        figures = self.hparams.figures
        return [] if figures is None or self.trainer.state.fn != "test" else [ClassificationFigures(**figures)]
