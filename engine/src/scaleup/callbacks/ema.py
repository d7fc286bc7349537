"""Exponential moving average of the weights, on Lightning's own EMAWeightAveraging.

What Lightning already does: the average is updated after every optimizer step (not every micro-batch, so
accumulation and device count do not change it), validation runs on the averaged weights, checkpoints hold the
averaged weights under `state_dict` (the training weights under `current_model_state`, restored on resume), and
the model ends training holding the average. So `eval.py` and `export.py`, which read `state_dict`, use the EMA
weights without knowing about it.
"""

from scaleup.compat.workarounds import EMA

__all__ = ["EMA"]  # scaleup/conf/callbacks/ema.yaml: scaleup.callbacks.ema.EMA
