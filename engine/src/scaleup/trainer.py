"""The Trainers the jobs run: the template's own callbacks in their checked order, then the user's, on the planned
topology; and what the jobs read back from them (`TrainerJob`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Checkpoint, EarlyStopping, LearningRateMonitor, ModelSummary, ProgressBar

from scaleup.callbacks.ema import EMA
from scaleup.callbacks.exact_metrics import ExactEvalMetrics
from scaleup.callbacks.lr_scaling import LRScaling
from scaleup.callbacks.metric_states import PrivateMetricStates
from scaleup.callbacks.performance import PerformanceSettings, set_tf32
from scaleup.callbacks.run_files import ConfigInCheckpoint, MetricsFile
from scaleup.checkpoints.io import AtomicCheckpointIO, remove_interrupted_writes
from scaleup.compat.fast_paths import LeanModelCheckpoint, fast_paths
from scaleup.compat.gates import (
    EMA_DEVICE,
    EPOCH_END_RESUME,
    EXACT_EVAL,
    FSDP_OPTIMIZER_KEYS,
    SIGTERM_HANDLER,
    SPAWN_LAUNCHER,
    require,
)
from scaleup.compat.launch import SpawnDDPStrategy
from scaleup.compat.loops import BatchProgressRescale, EpochEndResume, EpochProgressRepair, LoaderWorkersStop
from scaleup.compat.precision import model_parallel_precision
from scaleup.config.plain import instantiate_each
from scaleup.config.schema import Checkpointing, Monitor
from scaleup.config.typed import TrainConfig, values
from scaleup.data.seeding import StepSeed
from scaleup.distributed.clusters import cluster_plugins
from scaleup.distributed.fsdp import FSDPStrategy
from scaleup.distributed.preemption import PreemptionCheckpoint, StopOnSigterm, exit_when_stopped
from scaleup.errors import config_errors
from scaleup.observability.hparams import PlanHParams
from scaleup.observability.progress import ThrottledRichProgressBar
from scaleup.observability.quiet import SummaryWithoutUncountedFlops, quiet
from scaleup.plan.batch_probe import AutoBatchSize
from scaleup.plan.checks import MonitorCheck, TrainLoaderCheck
from scaleup.plan.resolve import Plan
from scaleup.plan.topology import Topology
from scaleup.search.trial import ReportToStudy, trial_callbacks


def checkpoint_callbacks(monitor: Monitor, checkpoint: Checkpointing) -> list[LeanModelCheckpoint]:
    """The best epoch by `monitor.metric` (what train.py tests), and last.ckpt: what `ckpt_path=last` resumes.

    last.ckpt is rewritten at every epoch's end, after its validation, and so at the end of training, which is an
    epoch's end however it comes (max_epochs, max_steps, early stopping); and with `checkpoint.every_n_train_steps`
    also every N optimizer steps in between. Separate callbacks because ModelCheckpoint(save_last=True) refreshes
    last.ckpt only when a new best is saved (Lightning 2.6: after the best epoch it would go stale), and because one
    ModelCheckpoint takes a step or an epoch trigger, not both: given `every_n_train_steps` it no longer saves at
    epoch ends, and last.ckpt would miss the steps after the last multiple of N.
    """
    metric, mode = monitor.metric, monitor.mode
    best = LeanModelCheckpoint(
        dirpath=checkpoint.dirpath,
        filename=f"best-epoch{{epoch:03d}}-{{{metric}:.4f}}",  # e.g. best-epoch011-0.9861.ckpt
        auto_insert_metric_name=False,  # metric names contain "/"
        monitor=metric,
        mode=mode,
        save_top_k=1,
    )
    last = {
        "dirpath": checkpoint.dirpath,
        "filename": "last",
        "save_top_k": 1,  # no monitor: keep only the newest
        "enable_version_counter": False,  # overwrite last.ckpt, never write last-v1.ckpt
    }
    # At the training epoch's end, not at a validation's end: also the epochs that check_val_every_n_epoch skips.
    every_epoch = LeanModelCheckpoint(**last, save_on_train_epoch_end=True)
    steps = checkpoint.every_n_train_steps
    every_n_steps = [LeanModelCheckpoint(**last, every_n_train_steps=steps)] if steps else []
    return [best, *every_n_steps, every_epoch]


# What each of the template's callbacks needs to run before (Lightning calls callbacks in list order).
ORDER = (
    (LRScaling, LearningRateMonitor, "the LR is set before LearningRateMonitor logs it"),
    (StepSeed, L.Callback, "the user's callbacks see (and a probe may draw from) the micro-batch's seeded stream"),
    (AutoBatchSize, BatchProgressRescale, "the micro-batch is settled before the accumulation is read"),
    (ExactEvalMetrics, Checkpoint, "eval metrics are exact before a checkpoint reads its monitor"),
    (ExactEvalMetrics, EarlyStopping, "eval metrics are exact before early stopping reads them"),
    (ExactEvalMetrics, MetricsFile, "eval metrics are exact before metrics.json is written"),
    (ExactEvalMetrics, ReportToStudy, "eval metrics are exact before a search's trial reports them"),
    (MetricsFile, PlanHParams, "PlanHParams reads the metric names MetricsFile wrote"),
)


def check_order(callbacks: list[L.Callback], template: int) -> None:
    """Every rule of ORDER holds, and StopOnSigterm is last (every other callback finishes the batch it stops
    after). `template`: how many of `callbacks` are the template's own; the rules' L.Callback means the user's."""
    for earlier, later, reason in ORDER:
        first = [i for i, cb in enumerate(callbacks) if isinstance(cb, earlier)]
        after = [
            i for i, cb in enumerate(callbacks) if isinstance(cb, later) and (later is not L.Callback or i >= template)
        ]
        assert not first or not after or max(first) < min(after), f"callback order: {reason}"
    assert isinstance(callbacks[-1], StopOnSigterm), "callback order: StopOnSigterm runs last"


@dataclass(frozen=True)
class TrainerJob:
    """A job's Trainer and the callbacks the job reads back: the stop flag, and the best checkpoint (training)."""

    trainer: L.Trainer
    stop: StopOnSigterm
    best: LeanModelCheckpoint | None = None
    fast: bool = False  # the speed-only fast paths (performance.fast_paths), installed only while `running`

    @contextlib.contextmanager
    def running(self, resume_hint: str) -> Iterator[None]:
        """Where the job runs `fit` and `test`: with the fast paths in place, removed after (a plain Trainer later
        in the process runs Lightning's own code); a SIGTERM ends it with exit code 143 and `resume_hint`."""
        with exit_when_stopped(self.stop, resume_hint), fast_paths(self.fast):
            yield


def template_callbacks(config: TrainConfig, plan: Plan, run_dir: Path) -> list[L.Callback]:
    """The machinery every training run has, in the order ORDER asks for."""
    return [
        LRScaling(plan.schedule()),
        StepSeed(plan.seed, plan.global_batch_size),
        *([AutoBatchSize(plan, run_dir / "batch_probe.json")] if plan.max_per_device_batch_size == "auto" else []),
        PrivateMetricStates(),
        ExactEvalMetrics(),
        MonitorCheck(config.monitor.metric, config.monitor.mode),
        TrainLoaderCheck(),
        ConfigInCheckpoint(config.plain, plan.to_dict()),
        *checkpoint_callbacks(config.monitor, config.checkpoint),
        PreemptionCheckpoint(config.checkpoint.dirpath),
        EpochProgressRepair(),
        EpochEndResume(),
        BatchProgressRescale(),
        LoaderWorkersStop(),
        MetricsFile(run_dir / "metrics.json"),
        *trial_callbacks(config.monitor.metric, str(run_dir)),
        PlanHParams(plan.to_dict(), run_dir / "metrics.json"),
        PerformanceSettings(plan.tf32, plan.channels_last),
    ]


def build_trainer(config: TrainConfig, plan: Plan, topology: Topology, strategy: Any, run_dir: Path) -> TrainerJob:
    """A Trainer with the template's callbacks and the user's, the loggers, and the plan's resolved settings."""
    quiet()
    set_tf32(plan.tf32)  # here too: Lightning checks the setting when it sets up the GPU, before any callback runs
    callbacks = template_callbacks(config, plan, run_dir)
    best = callbacks[[type(cb) for cb in callbacks].index(LeanModelCheckpoint)]  # the first: the best epoch
    template = len(callbacks)
    with config_errors("callbacks"):
        callbacks += instantiate_each(config.callbacks)
    # Lightning refuses a progress bar it was told not to show; and given none, it adds its TQDM bar, which redraws
    # after every step: the throttled one instead.
    if not config.trainer.enable_progress_bar:
        callbacks = [cb for cb in callbacks if not isinstance(cb, ProgressBar)]
    elif not any(isinstance(cb, ProgressBar) for cb in callbacks):
        callbacks.append(ThrottledRichProgressBar())
    # Where Lightning would add its default summary (with a FLOPs column of zeros for a module that has no
    # example_input_array), the template's instead; told to add none, Lightning does not say it skips its own.
    summary = config.trainer.enable_model_summary is not False and not config.trainer.barebones
    summary = summary and not any(isinstance(cb, ModelSummary) for cb in callbacks)
    if summary:
        callbacks.append(SummaryWithoutUncountedFlops())
    stop = StopOnSigterm()
    callbacks.append(stop)
    with config_errors("logger"):
        loggers = instantiate_each(config.logger)
    # Lightning refuses an LR monitor with nowhere to log.
    if not loggers:
        callbacks = [cb for cb in callbacks if not isinstance(cb, LearningRateMonitor)]
    check_order(callbacks, template)
    require(
        EXACT_EVAL,
        SIGTERM_HANDLER,
        *([SPAWN_LAUNCHER] if isinstance(strategy, SpawnDDPStrategy) else []),
        *([FSDP_OPTIMIZER_KEYS] if isinstance(strategy, FSDPStrategy) else []),
        *([EMA_DEVICE] if any(isinstance(cb, EMA) for cb in callbacks) else []),
        *([EPOCH_END_RESUME] if config.trainer.max_steps != -1 else []),
    )
    trainer_kwargs = {
        **values(config.trainer),
        "accelerator": topology.accelerator,
        "devices": topology.devices,
        "num_nodes": topology.num_nodes,
        "sync_batchnorm": plan.sync_batchnorm,
        "precision": plan.precision,
        "accumulate_grad_batches": plan.accumulate_grad_batches,
        "log_every_n_steps": plan.log_every_n_steps,
        **({"enable_model_summary": False} if summary else {}),
    }
    plugins: list[Any] = [AtomicCheckpointIO(), *cluster_plugins()]  # a PyTorchJob's ranks: distributed/clusters.py
    if isinstance(strategy, FSDPStrategy):
        trainer_kwargs["precision"], precision_plugins = model_parallel_precision(plan.precision)
        plugins += precision_plugins
    with config_errors("trainer"):
        trainer = L.Trainer(
            **trainer_kwargs,
            strategy=strategy,
            callbacks=callbacks,
            logger=loggers or False,
            plugins=plugins,
            default_root_dir=run_dir,
        )
    if trainer.is_global_zero:
        remove_interrupted_writes(config.checkpoint.dirpath)
    return TrainerJob(trainer, stop, best, fast=config.performance.fast_paths)


def build_eval_trainer(topology: Topology, precision: Any, plan: Plan, run_dir: Path, progress_bar: bool) -> TrainerJob:
    """The Trainer of `eval.py`: the checkpoint's own speed settings, exact metrics into metrics.json, no logger."""
    quiet()
    require(EXACT_EVAL, SIGTERM_HANDLER)
    stop = StopOnSigterm()
    tf32, channels_last = plan.tf32, plan.channels_last  # as trained
    set_tf32(tf32)  # here too: Lightning checks the setting when it sets up the GPU, before any callback runs
    callbacks = [
        ExactEvalMetrics(),
        MetricsFile(run_dir / "metrics.json"),
        PerformanceSettings(tf32, channels_last),
        stop,
    ]
    check_order(callbacks, len(callbacks))
    with config_errors("trainer"):
        trainer = L.Trainer(
            accelerator=topology.accelerator,
            devices=topology.devices,
            num_nodes=topology.num_nodes,
            precision=precision,
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=progress_bar,
            default_root_dir=run_dir,
        )
    return TrainerJob(trainer, stop)
