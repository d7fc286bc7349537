"""Experiment loggers beyond TensorBoard: W&B and MLflow runs that survive a requeue, and images for any logger."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
from lightning.pytorch.loggers import Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.utilities import rank_zero_only

from scaleup.distributed.run_dir import run_id

RUN_DIR_TAG = "run_dir"  # the MLflow tag that finds a run again


def wandb_logger(save_dir: str | Path, **kwargs: Any) -> WandbLogger:
    """Weights & Biases, named after the run directory, with the id `run_id` gives it; `resume="allow"` continues
    that run when the job comes back. Offline runs are uploaded later with `wandb sync <save_dir>/wandb`."""
    return WandbLogger(save_dir=str(save_dir), id=run_id(save_dir), name=Path(save_dir).name, resume="allow", **kwargs)


def mlflow_logger(run_dir: str | Path, tracking_uri: str, experiment_name: str, **kwargs: Any) -> Logger:
    """MLflow, named after the run directory. MLflow picks its own run ids, so each run carries its directory as
    a tag and a requeued job (same directory) finds its run by that tag and continues it.

    Only rank 0 logs (Lightning's loggers act on rank 0 only), and only rank 0 opens the tracking store: every
    process opening a new SQLite store at once would race to create its tables. The others get Lightning's
    DummyLogger, so callbacks that need a logger (the LR monitor) still find one.
    """
    if rank_zero_only.rank != 0:
        return DummyLogger()
    from mlflow import MlflowClient

    run_dir = str(Path(run_dir).resolve())
    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name(experiment_name)
    quoted = run_dir.replace("'", "\\'")
    existing = (
        client.search_runs([experiment.experiment_id], f"tags.{RUN_DIR_TAG} = '{quoted}'", max_results=1)
        if experiment is not None
        else []
    )
    return (ContinuedMLFlowLogger if existing else MLFlowLogger)(
        experiment_name=experiment_name,
        run_name=Path(run_dir).name,
        tracking_uri=tracking_uri,
        tags={RUN_DIR_TAG: run_dir},
        run_id=existing[0].info.run_id if existing else None,
        **kwargs,
    )


class ContinuedMLFlowLogger(MLFlowLogger):
    """An MLflow run found again after a requeue. MLflow refuses to change a param once logged, and a resumed
    run's plan may differ (more epochs, another device count), so the params stay those of the first start; the
    resume log names what changed, and plan.json holds the current plan."""

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


IMAGE_LOGGERS = (TensorBoardLogger, WandbLogger, MLFlowLogger)  # the loggers `log_image` writes images to


def takes_images(trainer: L.Trainer) -> bool:
    """Whether one of the run's loggers takes images (every process has the same loggers: the answer is the same
    on all of them)."""
    return any(isinstance(logger, IMAGE_LOGGERS) for logger in trainer.loggers)


def log_image(trainer: L.Trainer, tag: str, image: np.ndarray) -> None:
    """An RGB uint8 image (height, width, 3) to every logger that takes images (IMAGE_LOGGERS), at the current global
    step."""
    step = trainer.global_step
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_image(tag, image, step, dataformats="HWC")
        elif isinstance(logger, WandbLogger):
            logger.log_image(key=tag, images=[image], step=step)
        elif isinstance(logger, MLFlowLogger):
            logger.experiment.log_image(logger.run_id, image, key=tag.replace("/", "_"), step=step)


def close_loggers(trainer: L.Trainer) -> None:
    """End the W&B run this process holds, so that the next job of a sweep in the same process starts its own
    (wandb keeps one global run per process). The other loggers close their runs themselves."""
    if any(isinstance(logger, WandbLogger) for logger in trainer.loggers):
        import wandb

        wandb.finish()
