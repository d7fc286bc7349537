"""A next-token LightningModule: the template's second task, and the worked example of your own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torchmetrics.classification import MulticlassAccuracy

from scaleup.api import StageMetrics, build_optimizer


class CharLanguageModel(L.LightningModule):
    """Next-character prediction with `net`, any network mapping (batch, time) ids to (batch, time, vocab) logits.

    Logs `<stage>/loss` (cross-entropy per character, in nats; divide by ln 2 for bits per character),
    `<stage>/acc` (next-character accuracy) and `<stage>/samples` (blocks), exact on any number of devices.
    """

    def __init__(self, net: Mapping[str, Any], optimizer: Mapping[str, Any]) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = instantiate(dict(net))
        # micro average: correct and total counts, summed over every character of every process.
        self.metrics = StageMetrics({"acc": MulticlassAccuracy(net["vocab_size"], average="micro")})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(ids)

    def _step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> torch.Tensor:
        ids, targets = batch
        logits, targets = self(ids).flatten(0, 1), targets.flatten()
        # A mean over this device's characters. Every block has the same length and every device the same number
        # of blocks per step, so DDP's average over devices is the mean over the global batch.
        loss = F.cross_entropy(logits, targets)
        self.metrics.update(stage, logits, targets, batch_size=len(ids), loss=loss)
        self.metrics.log(self, stage, prog_bar=["loss"])
        return loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return build_optimizer(self.hparams.optimizer, self)
