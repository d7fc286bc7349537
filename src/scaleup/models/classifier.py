"""The LightningModule: any `net` from config, a loss, an optimizer, and exact metrics per stage."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from hydra.utils import instantiate

from scaleup.engine.metrics import StageMetrics

STAGES = ("train", "val", "test")


class ImageClassifier(L.LightningModule):
    """Cross-entropy classification around `net`.

    `net` is a Hydra-instantiable dict that includes `num_classes`. Args are plain containers (the job converts
    Hydra configs), so `save_hyperparameters` writes only dicts and numbers into checkpoints and
    `torch.load(..., weights_only=True)` can read them back.
    """

    def __init__(
        self,
        net: Mapping[str, Any],
        optimizer: Mapping[str, Any],
        label_smoothing: float = 0.0,
        compile: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = instantiate(dict(net))
        if compile:
            # In-place compile keeps parameter names: no `_orig_mod.` in checkpoints (torch.compile(net) adds it).
            self.net.compile()
        # Attributes, not a ModuleDict: "train" would shadow nn.Module.train.
        self.train_metrics, self.val_metrics, self.test_metrics = (StageMetrics(net["num_classes"]) for _ in STAGES)

    def setup(self, stage: str) -> None:
        # ddp_spawn hands the module to its processes through shared memory, so on CPU every rank's metric
        # states would be one shared tensor (each rank adding into the others' sums). Reset makes them private.
        for stage_metrics in (self.train_metrics, self.val_metrics, self.test_metrics):
            for _, metric in stage_metrics.items():
                metric.reset()

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
        metrics = getattr(self, f"{stage}_metrics")
        metrics.update(logits, y, loss)
        for name, metric in metrics.items():
            self.log(f"{stage}/{name}", metric, on_step=False, on_epoch=True, prog_bar=name == "acc")
        return loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._step(batch, "train")
        # This rank's loss for the per-step curve; the exact all-rank mean is `train/loss` at epoch end.
        self.log("train/loss_step", loss, on_step=True, on_epoch=False, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # No weight decay on norm weights and biases (1-d tensors): decaying them only hurts (Goyal et al. 2017).
        decay = [p for p in self.parameters() if p.requires_grad and p.ndim > 1]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.ndim <= 1]
        groups = [
            {"params": decay, "name": "decay"},
            {"params": no_decay, "name": "no_decay", "weight_decay": 0.0},
        ]
        # The LR here is the unscaled base LR; the LRScaling callback sets the scaled, warmed-up LR every step.
        return instantiate(dict(self.hparams.optimizer), _partial_=True)(groups)
