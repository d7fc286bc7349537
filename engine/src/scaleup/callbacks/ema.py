"""Exponential moving average of the weights, on Lightning's own EMAWeightAveraging.

What Lightning already does: the average is updated after every optimizer step (not every micro-batch, so
accumulation and device count do not change it), validation runs on the averaged weights, checkpoints hold the
averaged weights under `state_dict` (the training weights under `current_model_state`, restored on resume), and
the model ends training holding the average. So `eval.py` and `export.py`, which read `state_dict`, use the EMA
weights without knowing about it.
"""

from __future__ import annotations

import pkgutil
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import EMAWeightAveraging, WeightAveraging


class EMA(EMAWeightAveraging):
    """EMAWeightAveraging, testing the averaged weights of a checkpoint after `fit` too. Lightning 2.6.6. Reason:
    Lightning swaps the training weights back in from `current_model_state` whenever its average still exists,
    which it does after `fit`. Canary: test_ema_testing_a_checkpoint_after_fit_loads_the_training_weights.

    Its average lives on the training device given as `device` (`on_training_device`).
    """

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn == "fit":  # resume: restore the average and the training weights
            super().on_load_checkpoint(trainer, pl_module, checkpoint)


def on_training_device(callbacks: dict[str, Any] | None, accelerator: str) -> dict[str, Any]:
    """The callbacks group with the training device's type as `device` of each weight-averaging entry (the engine's
    EMA, Lightning's EMAWeightAveraging or WeightAveraging, a subclass of one) that names none.

    Lightning builds the average in `setup`, before the strategy moves the model, on `pl_module.device` (the CPU)
    unless given a device; there every step would copy all weights across. A type with no index is each rank's own
    GPU: Lightning sets the rank's current GPU (`strategy.setup_environment`) before callbacks' `setup`.
    Canary: test_ema_average_is_built_before_the_model_moves_to_its_device.
    """
    device = "cuda" if accelerator == "gpu" else "cpu"
    given = callbacks or {}
    return {name: {"device": device, **entry} if averages_weights(entry) else entry for name, entry in given.items()}


def averages_weights(entry: Any) -> bool:
    """Whether a callbacks entry builds a Lightning WeightAveraging (an unknown `_target_` is left to Hydra's own
    message)."""
    if not isinstance(entry, dict) or "_target_" not in entry:
        return False
    try:
        target = pkgutil.resolve_name(entry["_target_"])  # quietly: hydra's get_class logs an ERROR first
    except (ImportError, AttributeError, ValueError):
        return False
    return isinstance(target, type) and issubclass(target, WeightAveraging)
