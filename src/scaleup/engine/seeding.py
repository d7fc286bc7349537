"""One seed for the run; a distinct random stream per rank for dropout and augmentation."""

import random

import lightning as L
import numpy as np
import torch


def rank_seed(seed: int, rank: int, step: int = 0) -> int:
    """A 32-bit seed mixed from (seed, rank, step): unrelated streams, not seed + rank neighbours."""
    return int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0])


class PerRankSeed(L.Callback):
    """Reseeds python, numpy and torch on each rank when training starts.

    `seed_everything(seed)` runs before the model is built, so every rank initialises identical weights
    (DDP also broadcasts rank 0's). Left like that, every rank would then draw the same dropout masks and
    random augmentations: N copies of one stream instead of N streams. Seeding with the global step as well
    makes a resumed run reproducible too. Loader workers get their own seeds from Lightning
    (`seed_everything(..., workers=True)` mixes in worker id and rank).
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        seed = rank_seed(self.seed, trainer.global_rank, trainer.global_step)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)  # also seeds every CUDA device
