"""The training job behind `python train.py`: plan, train, test, summarise."""

from __future__ import annotations

import copy
import json
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor, ProgressBar
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig

from scaleup.engine.batch_probe import AutoBatchSize
from scaleup.engine.callbacks import (
    ConfigInCheckpoint,
    LRScaling,
    MetricsFile,
    PreemptionCheckpoint,
    PrivateMetricStates,
)
from scaleup.engine.callbacks.hparams import PlanHParams
from scaleup.engine.callbacks.lr_scaling import base_lrs
from scaleup.engine.callbacks.performance import PerformanceSettings, set_tf32
from scaleup.engine.checkpoint import (
    AtomicCheckpointIO,
    BatchProgressRescale,
    EpochProgressRepair,
    is_url,
    load_checkpoint,
    remove_interrupted_writes,
    strip_wrapper_prefixes,
)
from scaleup.engine.checks import (
    MonitorCheck,
    TrainLoaderCheck,
    check_config,
    check_data_config,
    has_batchnorm,
    pitfall_warnings,
)
from scaleup.engine.config import build_model, flatten, instantiate_each, log_rows, to_plain, write_yaml
from scaleup.engine.datamodule import GlobalBatchDataModule, apply_model_settings, sizes_for_plan
from scaleup.engine.errors import UserError, config_errors
from scaleup.engine.launch import (
    build_strategy,
    check_launcher,
    fresh_store_after_torchrun_restart,
    shut_down_process_group,
)
from scaleup.engine.loggers import close_loggers
from scaleup.engine.plan import Plan, build_plan
from scaleup.engine.seeding import PerRankSeed
from scaleup.engine.topology import Topology, resolve_topology

log = logging.getLogger("scaleup")

# Our sampler skips the steps a mid-epoch checkpoint already took (GlobalBatchSampler.resume), so Lightning's
# generic warning about non-resumable loaders does not apply.
warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")

EXIT_PREEMPTED = 143  # 128 + SIGTERM, the shell's convention for "terminated"


def resolve_ckpt_path(ckpt_path: str | None, run_dir: Path) -> Path | str | None:
    """`last` is this run directory's newest checkpoint: checkpoints/last.ckpt, or the hpc_ckpt_N.ckpt that
    Lightning saves on SLURM's pre-emption signal if that is newer. With none yet it starts from scratch, so
    one command both starts a job and resumes it after a restart. Anything else must be a checkpoint file (or
    a URL such as s3://bucket/run/last.ckpt, read through fsspec)."""
    if ckpt_path != "last":
        return ckpt_path if ckpt_path is None or is_url(ckpt_path) else Path(ckpt_path)
    candidates = [p for p in [run_dir / "checkpoints" / "last.ckpt", *run_dir.glob("hpc_ckpt_*.ckpt")] if p.is_file()]
    if not candidates:
        log.info(f"ckpt_path=last: no checkpoint in {run_dir} yet, starting from scratch")
        return None
    return max(candidates, key=lambda p: p.stat().st_mtime_ns)


def check_resume(path: Path, config: dict[str, Any], plan: Plan, model: L.LightningModule) -> None:
    """Open the checkpoint up front (clear errors, no traceback), refuse another network, report what changed.

    Runs before anything is written, so a bad resume leaves the run directory as it was.
    """
    checkpoint = load_checkpoint(path)
    if checkpoint.get("global_step", 0) >= plan.total_steps:
        raise UserError(
            f"{path} is at step {checkpoint['global_step']} (epoch {checkpoint.get('epoch')}), already at or past "
            f"this plan's {plan.total_steps} steps; raise trainer.max_epochs or trainer.max_steps to train further"
        )
    for name, state in checkpoint.get("callbacks", {}).items():
        if name.startswith("EarlyStopping") and state.get("stopping_reason_message"):
            raise UserError(
                f"{path} is from a run that early stopping ended at epoch {state['stopped_epoch']} "
                f"({state['stopping_reason_message'].strip()}); there is nothing to resume. To train on, start a new "
                "run, e.g. from these weights or with a larger callbacks.early_stopping.patience"
            )
    stored = checkpoint.get("scaleup", {})
    # Another network is one whose weights have other names or shapes; the config differences say why.
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    stored_shapes = {name: tuple(t.shape) for name, t in strip_wrapper_prefixes(checkpoint["state_dict"]).items()}
    if stored_shapes != shapes:
        before, now = flatten(stored.get("config", {}).get("model", {})), flatten(config["model"])
        diffs = [
            f"model.{k}={before.get(k)} (now {now.get(k)})" for k in sorted(before | now) if before.get(k) != now.get(k)
        ]
        changed = sorted(name for name in stored_shapes | shapes if stored_shapes.get(name) != shapes.get(name))
        raise UserError(
            f"{path} was trained with another network: {', '.join(diffs) or f'weights {changed[:3]} differ'}; "
            "resume with the same model settings, or start a new run"
        )
    if rank_zero_only.rank != 0:
        return
    previous = stored.get("plan", {})
    skipped = {"dataset_sizes", "sync_batchnorm_reason"}
    if plan.max_per_device_batch_size == "auto":  # settled again at the start of fit
        skipped |= {"per_device_batch_size", "accumulate_grad_batches", "bn_batch_size"}
    changed = [
        f"{key} {previous[key]} -> {value}"
        for key, value in plan.to_dict().items()
        if key in previous and previous[key] != value and key not in skipped
    ]
    log.info(f"resuming from {path}" + (f"; changed since: {', '.join(changed)}" if changed else ""))
    if "global_batch_size" in previous and previous["global_batch_size"] != plan.global_batch_size:
        log.warning(
            f"the global batch changed ({previous['global_batch_size']} -> {plan.global_batch_size}): "
            "the resumed run optimises differently from the original one"
        )


def early_stopping_config(callbacks_cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The EarlyStopping entry of the callbacks config (`callbacks=[default,early_stopping]`), if any."""
    entries = [c for c in callbacks_cfg.values() if isinstance(c, dict) and "_target_" in c]
    return next((c for c in entries if str(c["_target_"]).rsplit(".", 1)[-1] == "EarlyStopping"), None)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Plan the run, print and save the plan, then fit, test on the best checkpoint and summarise."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    topology = resolve_topology(cfg.trainer, dry_run=cfg.dry_run)
    if not cfg.dry_run:
        check_launcher(topology)
        fresh_store_after_torchrun_restart()

    # Same seed on every rank before the data and the model are built: the same splits (also where a data module
    # splits with the global random state) and identical initial weights everywhere.
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    check_data_config(cfg.data)
    with config_errors("data"):
        datamodule = instantiate(cfg.data)
    if not isinstance(datamodule, GlobalBatchDataModule):
        raise UserError(
            f"data._target_={cfg.data._target_} is not a scaleup.engine.datamodule.GlobalBatchDataModule: subclass "
            "it (implement build_splits()), so the plan knows the split sizes and every device count sees the same "
            "global batches"
        )
    # Download and set up the data before anything depends on it: the plan needs the split sizes, the model what
    # only the data knows (the number of classes). A dry run takes only what the data module states.
    dataset_sizes = sizes_for_plan(datamodule, run_dir=run_dir, dry_run=cfg.dry_run)
    config = to_plain(cfg)
    settings = datamodule.model_settings()
    apply_model_settings(config["model"], settings)
    model_cfg = config["model"]
    if unknown := [key for key, value in settings.items() if value is None]:  # a dry run without the data
        log.info(f"model.{', model.'.join(unknown)} unknown until the data is there: the dry run builds the net with 2")
        model_cfg = copy.deepcopy(model_cfg)
        apply_model_settings(model_cfg, dict.fromkeys(unknown, 2))
    with config_errors("model"):
        model = build_model(model_cfg, precision=config["trainer"]["precision"])
    batchnorm = has_batchnorm(model)

    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    with config_errors("trainer.strategy"):
        strategy, strategy_name = build_strategy(
            config["trainer"]["strategy"], config["ddp"], topology.world_size, multirun
        )
    with config_errors("model.optimizer"):  # e.g. a negative learning rate, refused by the optimizer
        lrs = base_lrs(model)
    plan = build_plan(
        topology=topology,
        trainer_cfg=config["trainer"],
        data_cfg=config["data"],
        lr_cfg=config["callbacks"]["lr_scaling"],
        base_lrs=lrs,
        seed=cfg.seed,
        dataset_sizes=dataset_sizes,
        has_batchnorm=batchnorm,
        strategy=strategy_name,
        early_stopping=early_stopping_config(config["callbacks"]),
    )
    check_config(config, plan)
    ckpt_path = None if cfg.dry_run else resolve_ckpt_path(cfg.ckpt_path, run_dir)
    if ckpt_path is not None:
        check_resume(ckpt_path, config, plan, model)
    if rank_zero_only.rank == 0:
        announce(plan, config, run_dir, datamodule, has_batchnorm=batchnorm, dry_run=cfg.dry_run)
    if cfg.dry_run:
        return plan.to_dict()

    set_tf32(plan.tf32)  # here too: Lightning checks the setting when it sets up the GPU, before any callback runs
    trainer = build_trainer(config, plan, topology, strategy, run_dir)
    return fit_and_test(trainer, model, datamodule, ckpt_path, run_dir)


def announce(
    plan: Plan,
    config: dict[str, Any],
    run_dir: Path,
    datamodule: L.LightningDataModule,
    has_batchnorm: bool,
    dry_run: bool,
) -> None:
    """Rank 0: print the plan and the pitfall warnings, write plan.json and config.yaml."""
    log_rows("plan" + (" (dry run: nothing is started)" if dry_run else ""), plan.rows())
    for warning in pitfall_warnings(
        plan,
        has_batchnorm=has_batchnorm,
        num_workers=config["data"].get("num_workers", 0),
        data_in_memory=getattr(datamodule, "in_memory", False),
    ):
        log.warning(warning)
    (run_dir / "plan.json").write_text(json.dumps(plan.to_dict(), indent=2) + "\n")
    write_yaml(config, run_dir / "config.yaml")


def build_trainer(config: dict[str, Any], plan: Plan, topology: Topology, strategy: Any, run_dir: Path) -> L.Trainer:
    checkpoint_dir = run_dir / "checkpoints"
    lr_cfg = config["callbacks"]["lr_scaling"]
    callbacks = [
        # First: the LR must be set before LearningRateMonitor reads it.
        LRScaling(plan.schedule(tuple(lr_cfg.get("milestones") or ()), lr_cfg.get("gamma", 0.1))),
        PerRankSeed(plan.seed),
        # Settles the micro-batch at the start of fit, before BatchProgressRescale reads the accumulation.
        *([AutoBatchSize(plan, run_dir / "plan.json")] if plan.max_per_device_batch_size == "auto" else []),
        PrivateMetricStates(),
        MonitorCheck(config["monitor"]["metric"], config["monitor"]["mode"]),
        TrainLoaderCheck(),
        ConfigInCheckpoint(config, plan.to_dict()),
        PreemptionCheckpoint(checkpoint_dir),
        EpochProgressRepair(),
        BatchProgressRescale(),
        MetricsFile(run_dir / "metrics.json"),
        PlanHParams(plan.to_dict(), run_dir / "metrics.json"),  # after MetricsFile: reads the names it wrote
        PerformanceSettings(plan.tf32, plan.channels_last),
    ]
    with config_errors("callbacks"):
        callbacks += instantiate_each(config["callbacks"])
    with config_errors("logger"):
        loggers = instantiate_each(config["logger"])
    # Lightning refuses a progress bar it was told not to show, and an LR monitor with nowhere to log.
    if not config["trainer"].get("enable_progress_bar", True):
        callbacks = [cb for cb in callbacks if not isinstance(cb, ProgressBar)]
    if not loggers:
        callbacks = [cb for cb in callbacks if not isinstance(cb, LearningRateMonitor)]
    planned = ("strategy", "sync_batchnorm", "precision", "tf32", "channels_last", "accumulate_grad_batches")
    trainer_kwargs = {k: v for k, v in config["trainer"].items() if k not in planned}
    trainer_kwargs.update(accelerator=topology.accelerator, devices=topology.devices, num_nodes=topology.num_nodes)
    with config_errors("trainer"):
        trainer = L.Trainer(
            **trainer_kwargs,
            strategy=strategy,
            sync_batchnorm=plan.sync_batchnorm,
            precision=plan.precision,
            accumulate_grad_batches=plan.accumulate_grad_batches,
            callbacks=callbacks,
            logger=loggers or False,
            plugins=[AtomicCheckpointIO()],
            default_root_dir=run_dir,
        )
    if trainer.is_global_zero:
        remove_interrupted_writes(checkpoint_dir)
    return trainer


def fit_and_test(
    trainer: L.Trainer,
    model: L.LightningModule,
    datamodule: L.LightningDataModule,
    ckpt_path: Path | None,
    run_dir: Path,
) -> dict[str, Any]:
    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    except SIGTERMException:
        if trainer.is_global_zero:
            log.warning(f"resume with: python train.py ckpt_path=last hydra.run.dir={run_dir} (plus your overrides)")
        sys.exit(EXIT_PREEMPTED)
    stopper = trainer.early_stopping_callback
    if stopper is not None and stopper.stopping_reason_message and trainer.is_global_zero:
        log.info(
            f"early stopping ended the run at step {trainer.global_step} of the {trainer.estimated_stepping_batches} "
            f"planned (epoch {stopper.stopped_epoch}): {stopper.stopping_reason_message.strip()}"
        )
    monitored = next((cb for cb in trainer.checkpoint_callbacks if cb.monitor), None)  # callbacks.best_checkpoint
    best = monitored.best_model_path if monitored else ""
    trainer.test(model, datamodule=datamodule, ckpt_path=best or None, verbose=False)
    close_loggers(trainer)
    shut_down_process_group()
    if not trainer.is_global_zero:
        return {}
    # Read back what rank 0 wrote: with ddp_spawn, training and testing ran in child processes.
    metrics = json.loads((run_dir / "metrics.json").read_text())
    summarise(run_dir, metrics, best, monitored.monitor if monitored else "")
    return metrics


def summarise(run_dir: Path, metrics: dict[str, float], best: str, monitor: str) -> None:
    shown = [(name, f"{value:.4f}" if isinstance(value, float) else str(value)) for name, value in metrics.items()]
    shown = [row for row in shown if row[0].split("/")[0] in ("val", "test") or row[0] == "train/loss"]
    log_rows(f"done: {run_dir}", sorted(shown))
    if best:
        log.info(
            f"tested the best checkpoint by {monitor}: {best}\nevaluate it again with: python eval.py ckpt_path={best}"
        )
