"""What every run leaves besides the weights: metrics.json, the config and plan inside each checkpoint, and the plan
where runs get compared (every logger's hyperparameters, TensorBoard's HParams tab)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.tensorboard.summary import hparams

from scaleup.checkpoints.resume import TEST_PREFIX, log_lr_changes
from scaleup.compat.loggers import add_summaries
from scaleup.config.plain import flatten, is_plain
from scaleup.config.stored import stored_plan
from scaleup.plan.lr import lr_groups
from scaleup.plan.resolve import Plan

log = logging.getLogger("scaleup")


def flat_plan(plan: dict[str, Any]) -> dict[str, bool | int | float | str]:
    """The plan's set entries, nested dicts as `outer/inner`, lists as text (TensorBoard's HParams take no
    containers)."""
    flat = flatten(plan, sep="/")
    return {k: str(list(v)) if isinstance(v, list | tuple) else v for k, v in flat.items() if v is not None}


class RunFiles(L.Callback):
    """The run's records, from rank 0.

    - `metrics.json`: the final value of every logged metric, merged in after fit and after test. Merging through
      the file, not an in-memory dict, keeps fit and test metrics together when each stage runs in its own
      processes (ddp_spawn starts new ones for `trainer.test`). At the end of fit it drops the test metrics that an
      earlier, shorter fit of the run left (a run trained further with `ckpt_path=last`): they belong to other
      weights, and until this fit's test writes its own, their absence tells a requeue that the test is still to
      run (checkpoints/resume.py).
    - With `config` and `plan` (training): both inside each checkpoint as plain dicts, so that `eval.py` and
      `export.py` rebuild the model and data without the user repeating the training overrides; the plan (world
      size, batches, accumulation, peak LR, steps, precision, strategy, SyncBN) as every logger's hyperparameters
      under `plan/` when fit starts; and, after the test, TensorBoard's HParams tab: the plan beside the names of
      the final metrics, so that runs on 1, 2 and 8 GPUs line up as rows of one table. The tab reads the values
      from the scalars already logged: writing them again would add a point to every curve.
    - The plan's param group LRs (Plan.base_lrs), when fit starts: read from the optimizers Lightning built, its
      one call of `configure_optimizers` (StepPlan's LRScaling, before this callback, refused a returned scheduler).
    """

    def __init__(self, path: str | Path, config: dict[str, Any] | None = None, plan: dict[str, Any] | None = None):
        self.path, self.config, self.plan = Path(path), config, plan
        self.trained_plan: Plan | None = None  # the plan of the checkpoint that fit resumes from

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self.trained_plan = stored_plan(checkpoint)  # Lightning restores callbacks before fit starts

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.plan is not None and self.plan["base_lrs"] is None:
            self.plan = self._with_base_lrs(trainer)
        if self.plan is not None:
            for logger in trainer.loggers:
                logger.log_hyperparams({"plan": self.plan})

    def _with_base_lrs(self, trainer: L.Trainer) -> dict[str, Any]:
        """The plan with each param group's LR; rank 0 shows them, adds them to plan.json (beside metrics.json,
        where train.py wrote the plan) and warns where a resume changed them."""
        plan = Plan.from_dict(self.plan or {}).with_base_lrs(lr_groups(trainer.optimizers))
        if trainer.is_global_zero:
            log.info(f"learning rate: {dict(plan.rows())['learning rate']}")
            self.path.with_name("plan.json").write_text(json.dumps(plan.to_dict(), indent=2) + "\n")
            if trainer.ckpt_path is not None:
                log_lr_changes(trainer.ckpt_path, self.trained_plan, plan)
        return plan.to_dict()

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if self.config is not None:
            checkpoint["scaleup"] = {"config": self.config, "plan": self.plan}
            # A module given built objects (a `net: nn.Module`) saves them among its hyperparameters, which a
            # weights_only read refuses: their configs instead, which rebuild them.
            for key, section in (("hyper_parameters", "model"), ("datamodule_hyper_parameters", "data")):
                hparams = checkpoint.get(key) or {}
                for name, value in hparams.items():
                    if not is_plain(value):
                        hparams[name] = self.config[section].get(name)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer, drop_test=True)

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        metrics = self._write(trainer)
        if metrics is not None and self.plan is not None:
            names = dict.fromkeys(metrics, 0.0)  # only the names are written
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    add_summaries(logger, list(hparams(flat_plan(self.plan), names)), trainer.global_step)

    @rank_zero_only
    def _write(self, trainer: L.Trainer, *, drop_test: bool = False) -> dict[str, float | str]:
        metrics = json.loads(self.path.read_text()) if self.path.is_file() else {}
        if drop_test:
            metrics = {name: value for name, value in metrics.items() if not name.startswith(TEST_PREFIX)}
        for name, value in trainer.callback_metrics.items():
            value = float(value)
            metrics[name] = value if math.isfinite(value) else str(value)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(dict(sorted(metrics.items())), indent=2) + "\n")
        return metrics
