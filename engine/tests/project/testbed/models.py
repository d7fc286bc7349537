"""A classifier around any configured `net`, a small CNN with a choice of norm, and torchvision's ResNets."""

from collections.abc import Callable, Mapping
from itertools import pairwise
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
import torchvision
from hydra.utils import instantiate
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from scaleup.api import ClassificationFigures, StageMetrics, build_optimizer

Norm = Literal["batch", "group", "none"]


def norm_layer(kind: Norm) -> Callable[[int], nn.Module]:
    if kind == "group":
        return lambda channels: nn.GroupNorm(min(32, channels // 4), channels)
    return nn.BatchNorm2d if kind == "batch" else lambda channels: nn.Identity()


class DigitsCNN(nn.Sequential):
    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 1,
        width: int = 32,
        norm: Norm = "batch",
        dropout: float = 0.0,
    ) -> None:
        widths = [in_channels, width, 2 * width, 4 * width]
        layers: list[nn.Module] = []
        for i, (cin, cout) in enumerate(pairwise(widths)):
            layers += [nn.Conv2d(cin, cout, 3, padding=1, bias=norm == "none"), norm_layer(norm)(cout), nn.ReLU(True)]
            layers += [nn.MaxPool2d(2)] if i == 1 else []
        head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout), nn.Linear(4 * width, num_classes)]
        super().__init__(*layers, *head)


def resnet(
    name: str, num_classes: int, in_channels: int = 3, norm: Norm = "batch", small_input: bool = False
) -> nn.Module:
    net = getattr(torchvision.models, name)(num_classes=num_classes, norm_layer=norm_layer(norm))
    if small_input or in_channels != 3:
        stem = (3, 1, 1) if small_input else (7, 2, 3)
        net.conv1 = nn.Conv2d(in_channels, 64, stem[0], stride=stem[1], padding=stem[2], bias=False)
    if small_input:
        net.maxpool = nn.Identity()
    return net


class ImageClassifier(L.LightningModule):
    def __init__(
        self,
        net: Mapping[str, Any],
        optimizer: Mapping[str, Any],
        label_smoothing: float = 0.0,
        compile: bool = False,
        figures: Mapping[str, Any] | None = None,
        lr_scales: Mapping[str, float] | None = None,  # a factor on the base LR by parameter name (build_optimizer)
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = instantiate(dict(net))
        if compile:
            self.net.compile()
        classes = net["num_classes"]
        top5 = {"acc5": MulticlassAccuracy(classes, top_k=5, average="micro")} if classes > 5 else {}
        self.metrics = StageMetrics({"acc": MulticlassAccuracy(classes, average="micro"), **top5}, eval_only=list(top5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.evaluate(batch, "train")
        self.log("train/loss_step", loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.evaluate(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.evaluate(batch, "test")

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The mean over this device's batch: DDP's averaging of gradients makes it the global batch's mean."""
        return F.cross_entropy(logits, target, label_smoothing=self.hparams.label_smoothing)

    def evaluate(self, batch: Any, stage: str) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = self.loss(logits, y)
        self.metrics.update(stage, logits, y, batch_size=len(y), loss=loss)
        self.metrics.log(self, stage, prog_bar=["acc"])
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return build_optimizer(self.hparams.optimizer, self, self.hparams.lr_scales)

    def configure_callbacks(self) -> list[L.Callback]:
        return [] if self.hparams.figures is None else [ClassificationFigures(**self.hparams.figures)]
