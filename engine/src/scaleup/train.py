"""The training job behind `python train.py`: data, model, plan, trainer, fit, test, summary."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import get_method
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from scaleup.build import build_data_and_model
from scaleup.callbacks.loop_repairs import ignore_unresumable_loader_warning
from scaleup.callbacks.preemption import FailureRecord
from scaleup.checkpoints.resume import ResumePoint, check_run_dir, resume_point
from scaleup.config.outputs import check_outputs
from scaleup.config.plain import instantiate_each, write_yaml
from scaleup.config.typed import TrainConfig, target, train_config
from scaleup.data.datamodule import GlobalBatchDataModule
from scaleup.distributed.launch import check_launch, prepare_launch, shards_the_model, watch_the_set_up
from scaleup.distributed.process_group import shut_down_process_group
from scaleup.errors import UserError, config_errors, in_search
from scaleup.observability.loggers import close_loggers
from scaleup.observability.quiet import quiet_reattached_callbacks
from scaleup.observability.rows import log_rows
from scaleup.plan.checks import own_train_loader_warning, pitfall_warnings
from scaleup.plan.make import make_plan
from scaleup.plan.resolve import Plan
from scaleup.plan.topology import resolve_topology
from scaleup.trainer import build_trainer, check_trainer_arguments, check_validation_interval, on_training_device

log = logging.getLogger("scaleup")

# Our sampler skips the steps a mid-epoch checkpoint already took (GlobalBatchSampler.resume).
ignore_unresumable_loader_warning()


def train(cfg: DictConfig) -> dict[str, Any]:
    """Plan the run, print and save the plan, then fit, test on the best checkpoint and summarise; a failure says why
    in the run directory (train.log, failure.json)."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    with FailureRecord(run_dir) as failure:
        return train_in(cfg, run_dir, failure)


def train_in(cfg: DictConfig, run_dir: Path, failure: FailureRecord) -> dict[str, Any]:
    """`train` in `run_dir`; `failure` is told when training starts."""
    config = train_config(cfg)  # every value's type and range, before the seed and the topology read theirs
    # and, in a dry run, the values passed to lightning.Trainer as they are, by Lightning (a run's own Trainer does)
    probe = check_trainer_arguments(config.trainer, probe=config.dry_run)
    check_run_dir(config, run_dir)  # a directory that holds a run: resumed, started over on request, or refused
    topology = resolve_topology(config.trainer, dry_run=config.dry_run)
    check_outputs(config)  # before an epoch is trained, or data downloaded, for nothing
    check_launch(topology, dry_run=config.dry_run)
    if not config.dry_run:
        watch_the_set_up(config.strategy, topology, run_dir, multirun=HydraConfig.get().mode == RunMode.MULTIRUN)
    check_diagnostics_from(config)
    # Same seed on every rank before the data and the model are built: the same splits (also where a data module
    # splits with the global random state) and identical initial weights everywhere.
    L.seed_everything(config.seed, workers=True, verbose=False)
    launch = prepare_launch(
        config.strategy,
        topology,
        multirun=HydraConfig.get().mode == RunMode.MULTIRUN,
        dry_run=config.dry_run,
        async_save=config.checkpoint.async_save,
    )
    datamodule, model, dataset_sizes = build_data_and_model(config, run_dir, launch.strategy)
    # The meta build's recording (strategy=fsdp's build_model), which init.weights are read into for each rank's shards
    recording = getattr(launch.strategy, "recording", None)
    # init's part, which its option names (finetune.py's prepare_start): init.freeze applied before the plan counts what
    # trains; init.weights loaded once the run knows it does not resume (start.begin)
    start = get_method(target(config.init))(config.init, model)
    # A dry run plans the meta build without recording it; a real one may have built the ordinary way (it warned).
    on_meta = shards_the_model(config.strategy, topology.world_size) and config.strategy.meta_init
    plan = make_plan(
        config,
        topology,
        launch,
        model,
        dataset_sizes,
        on_meta=on_meta and (config.dry_run or recording is not None),
        probe=probe,
    )
    check_validation_interval(config.trainer, plan)  # in batches, which only the plan counts
    resume = resume_point(None if config.dry_run else config.ckpt_path, config, plan, model, datamodule, run_dir)
    if resume.tested:
        return already_finished(run_dir, resume, config.monitor.metric)
    plan = start.begin(plan, model, recording, resumed=resume.path, dry_run=config.dry_run)  # a resume loads none
    # The run's one Trainer, before the plan is printed: a `trainer.*` value Lightning refuses is one line first.
    # Constructing it starts no process (Lightning's launcher starts them in fit).
    job = None if config.dry_run else build_trainer(config, plan, topology, launch.strategy, run_dir)
    report = dry_run_report(config, plan, cfg, topology.accelerator) if config.diagnostics_from else []
    if rank_zero_only.rank == 0:
        announce(plan, config, run_dir, datamodule)
        for level, line in report:
            log.log(level, line)
    if job is None:  # a dry run
        return plan.to_dict()

    trainer = job.trainer
    hint = f"resume with: python train.py ckpt_path=last hydra.run.dir={run_dir} (plus your overrides)"
    if in_search():
        hint = "resume the search with the same command: it resumes this trial from its last.ckpt"
    failure.started = True
    with job.running(hint):
        if resume.finished:
            log.info(f"{resume.path} finished training at step {resume.step}: running its test")
        else:
            trainer.fit(model, datamodule=datamodule, ckpt_path=resume.path)
            report_early_stop(trainer)
        best = resume.best if resume.finished else job.best.best_model_path
        with quiet_reattached_callbacks():
            trainer.test(model, datamodule=datamodule, ckpt_path=best or None, verbose=False)
    close_loggers(trainer)
    shut_down_process_group()
    if not trainer.is_global_zero:
        return {}
    # Read back what rank 0 wrote: with ddp_spawn, training and testing ran in child processes.
    metrics = json.loads((run_dir / "metrics.json").read_text())
    summarise(run_dir, metrics, best, config.monitor.metric)
    for callback in trainer.callbacks:  # the run's last lines: a callback's own findings (TrainingDiagnostics')
        for line in getattr(callback, "closing_lines", lambda *_: [])(trainer, metrics):
            log.info(line)
    return metrics


def check_diagnostics_from(config: TrainConfig) -> None:
    """`diagnostics_from` names a measured run for a dry run's speedup estimate: a UserError without a dry run (a
    training run would ignore it)."""
    if config.diagnostics_from is not None and not config.dry_run:
        raise UserError(
            f"diagnostics_from={config.diagnostics_from} is read by a dry run only: add dry_run=true to get the "
            "speedup estimate for this topology"
        )


def dry_run_report(config: TrainConfig, plan: Plan, cfg: DictConfig, accelerator: str) -> list[tuple[int, str]]:
    """What the `callbacks` group's callbacks add to a dry run's plan for `diagnostics_from`, as (log level, line):
    each one's `dry_run_report(config, plan, given)` where it has one (TrainingDiagnostics: the speedup estimate).
    Computed before the plan is written, so that a mistake it finds leaves nothing behind. Only then are the
    callbacks built in a dry run: it plans a cluster's job on a laptop, where a callback's package may be missing."""
    with config_errors("callbacks"):
        callbacks = instantiate_each(on_training_device(config.callbacks, accelerator))
    given = OmegaConf.to_container(cfg)
    report = [
        entry
        for callback in callbacks
        if (hook := getattr(callback, "dry_run_report", None))
        for entry in hook(config, plan.to_dict(), given)
    ]
    if config.diagnostics_from is not None and not report:
        raise UserError(
            f"diagnostics_from={config.diagnostics_from}: no callback of this run estimates from it; the diagnostics "
            "callback does (callbacks.diagnostics, in callbacks=default)"
        )
    return report


def announce(plan: Plan, config: TrainConfig, run_dir: Path, datamodule: GlobalBatchDataModule) -> None:
    """Rank 0: print the plan and the pitfall warnings, write plan.json and config.yaml."""
    log_rows("plan" + (" (dry run: nothing is started)" if config.dry_run else ""), plan.rows())
    in_memory = getattr(datamodule, "in_memory", False)
    net = config.model.get("net")
    warnings = pitfall_warnings(
        plan,
        has_batchnorm=plan.has_batchnorm,
        num_workers=config.batches.num_workers,
        data_in_memory=in_memory,
        norm_key="model.net.norm" if isinstance(net, dict) and "norm" in net else None,
    )
    for warning in [*warnings, own_train_loader_warning(datamodule)]:
        if warning:
            log.warning(warning)
    (run_dir / "plan.json").write_text(json.dumps(plan.to_dict(), indent=2) + "\n")
    write_yaml(config.plain, run_dir / "config.yaml")


def already_finished(run_dir: Path, resume: ResumePoint, monitor: str) -> dict[str, Any]:
    """A requeue of a run that trained and tested to its end: say so and show its results; no process starts, no
    file is written (every rank finds the same last.ckpt and metrics.json, and returns here)."""
    shut_down_process_group()  # where the launcher started one before the job (Ray Train), as after a test
    if rank_zero_only.rank != 0:
        return {}
    log.info(
        f"the run already finished: {resume.path} is at its last step ({resume.step}) and its test results are in "
        f"{run_dir / 'metrics.json'}; nothing to do"
    )
    metrics = json.loads((run_dir / "metrics.json").read_text())
    summarise(run_dir, metrics, resume.best, monitor)
    return metrics


def report_early_stop(trainer: L.Trainer) -> None:
    stopper = trainer.early_stopping_callback
    if stopper is not None and stopper.stopping_reason_message and trainer.is_global_zero:
        log.info(
            f"early stopping ended the run at step {trainer.global_step} of the {trainer.estimated_stepping_batches} "
            f"planned (epoch {stopper.stopped_epoch}): {stopper.stopping_reason_message.strip()}"
        )


def summarise(run_dir: Path, metrics: dict[str, float], best: str, monitor: str) -> None:
    shown = [(name, f"{value:.4f}" if isinstance(value, float) else str(value)) for name, value in metrics.items()]
    log_rows(f"done: {run_dir}", sorted(shown))
    if best:
        log.info(
            f"tested the best checkpoint by {monitor}: {best}\nevaluate it again with: python eval.py ckpt_path={best}"
        )
