"""The plan as every logger's hyperparameters, and TensorBoard's HParams tab: the plan beside the final metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.tensorboard.summary import hparams

from scaleup.compat.loggers import add_summaries
from scaleup.config.plain import flatten


def flat_plan(plan: dict[str, Any]) -> dict[str, bool | int | float | str]:
    """The plan's set entries, nested dicts as `outer/inner`, lists as text (TensorBoard's HParams take no
    containers)."""
    flat = flatten(plan, sep="/")
    return {k: str(list(v)) if isinstance(v, list | tuple) else v for k, v in flat.items() if v is not None}


class PlanHParams(L.Callback):
    """Puts the plan (world size, batches, accumulation, peak LR, steps, precision, strategy, SyncBN) where
    runs get compared.

    - Every logger gets it as hyperparameters under `plan/` when fit starts: `hparams.yaml` of TensorBoard and
      CSV, the run config of W&B, the params of MLflow.
    - TensorBoard's HParams tab gets the plan and the names of the final metrics after the test, so runs on 1, 2
      and 8 GPUs line up as rows of one table (`tensorboard --logdir outputs`). The names are those of
      `metrics.json` (MetricsFile, earlier in the callback list, has just merged the test metrics into it; fit
      and test may run in different processes under ddp_spawn). The tab reads the values from the scalars
      already logged: writing them again would add a point to every curve.
    """

    def __init__(self, plan: dict[str, Any], metrics_path: str | Path) -> None:
        self.plan, self.metrics_path = plan, Path(metrics_path)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            for logger in trainer.loggers:
                logger.log_hyperparams({"plan": self.plan})

    @rank_zero_only
    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        metrics = dict.fromkeys(json.loads(self.metrics_path.read_text()), 0.0)  # only the names are written
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                add_summaries(logger, list(hparams(flat_plan(self.plan), metrics)), trainer.global_step)
