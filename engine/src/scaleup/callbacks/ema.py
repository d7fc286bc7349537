"""Exponential moving average of the weights, on Lightning's own EMAWeightAveraging.

What Lightning already does: the average is updated after every optimizer step (not every micro-batch, so
accumulation and device count do not change it), validation runs on the averaged weights, checkpoints hold the
averaged weights under `state_dict` (the training weights under `current_model_state`, restored on resume), and
the model ends training holding the average. So `eval.py` and `export.py`, which read `state_dict`, use the EMA
weights without knowing about it.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import EMAWeightAveraging


class EMA(EMAWeightAveraging):
    """EMAWeightAveraging, testing the averaged weights of a checkpoint after `fit` too. Lightning 2.6.6. Reason:
    Lightning swaps the training weights back in from `current_model_state` whenever its average still exists,
    which it does after `fit`. Canary: test_ema_testing_a_checkpoint_after_fit_loads_the_training_weights.

    Its average lives on the training device given as `device` (trainer.py's `on_training_device`).
    """

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn == "fit":  # resume: restore the average and the training weights
            super().on_load_checkpoint(trainer, pl_module, checkpoint)
