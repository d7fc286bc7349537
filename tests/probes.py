"""Test-only callbacks, added to real runs with `+callbacks.probe._target_=probes.RankProbe`.

They record what each rank actually saw, so tests can check rank-level guarantees from outside.
"""

import json
import os
from pathlib import Path

import lightning as L
import torch

from scaleup.models.nets import parameter_checksum


class RankProbe(L.Callback):
    """Writes rank<r>.json: initial weights checksum, a dropout draw, and the sample indices of each epoch."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.record: dict = {"epochs": {}}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Before DDP wraps the model (and broadcasts rank 0's weights): what this rank built by itself.
        self.record["initial_checksum"] = parameter_checksum(pl_module.net)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.record["rank"] = trainer.global_rank
        self.record["world_size"] = trainer.world_size
        # After PerRankSeed: the stream dropout and augmentation draw from on this rank.
        self.record["dropout_mask"] = torch.nn.functional.dropout(torch.ones(64), p=0.5).nonzero().flatten().tolist()

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        sampler = trainer.train_dataloader.sampler  # the sampler this rank's loader iterates, after set_epoch
        self.record["epochs"][str(trainer.current_epoch)] = list(iter(sampler))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.record))
        (self.out_dir / f"pid{trainer.global_rank}").write_text(str(os.getpid()))


class StopAfterEpochs(L.Callback):
    """Ends fit after `epochs` epochs while the plan still counts the full run: an interruption, cleanly."""

    def __init__(self, epochs: int) -> None:
        self.epochs = epochs

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch + 1 >= self.epochs:
            trainer.should_stop = True
