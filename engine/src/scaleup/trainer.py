"""The Trainers the jobs run: the template's own callbacks in their fixed order, then the user's, on the planned
topology; and what the jobs read back from them (`TrainerJob`)."""

from __future__ import annotations

import contextlib
import logging
import math
import pkgutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.callbacks import (
    LearningRateMonitor,
    ModelCheckpoint,
    ProgressBar,
    WeightAveraging,
)
from lightning.pytorch.utilities.rank_zero import rank_zero_module, rank_zero_only

from scaleup.callbacks.exact_metrics import ExactEvalMetrics
from scaleup.callbacks.loop_repairs import LoopRepairs, install_fit_loop_fixes
from scaleup.callbacks.lr_scaling import LRScaling
from scaleup.callbacks.performance import set_tf32
from scaleup.callbacks.preemption import JobControl, exit_when_stopped
from scaleup.callbacks.progress import SteadyRichProgressBar
from scaleup.callbacks.run_files import RunFiles
from scaleup.callbacks.step_plan import StepPlan
from scaleup.callbacks.step_seed import StepSeed
from scaleup.checkpoints.io import AtomicCheckpointIO, remove_interrupted_writes
from scaleup.compat.gates import (
    EMA_DEVICE,
    EPOCH_END_RESUME,
    EXACT_EVAL,
    SIGTERM_HANDLER,
    require,
)
from scaleup.conf import group_values
from scaleup.config.plain import instantiate_each
from scaleup.config.schema import Checkpointing, Monitor, TrainerArgs, render
from scaleup.config.typed import TrainConfig, values
from scaleup.distributed.clusters import cluster_plugins
from scaleup.errors import UserError, config_errors, first_line
from scaleup.observability.quiet import quiet
from scaleup.plan.progress import StopAtPlannedSteps
from scaleup.plan.resolve import Plan
from scaleup.plan.topology import Topology
from scaleup.registry import registered

log = logging.getLogger("scaleup")


def checkpoint_callbacks(monitor: Monitor, checkpoint: Checkpointing) -> list[ModelCheckpoint]:
    """The best epoch by `monitor.metric` (what train.py tests), and last.ckpt: what `ckpt_path=last` resumes.

    last.ckpt is rewritten at every epoch's end, after its validation, and so at the end of training, which is an
    epoch's end however it comes (max_epochs, max_steps, early stopping); and with `checkpoint.every_n_train_steps`
    also every N optimizer steps in between. Separate callbacks because ModelCheckpoint(save_last=True) refreshes
    last.ckpt only when a new best is saved (Lightning 2.6: after the best epoch it would go stale), and because one
    ModelCheckpoint takes a step or an epoch trigger, not both: given `every_n_train_steps` it no longer saves at
    epoch ends, and last.ckpt would miss the steps after the last multiple of N.
    """
    metric, mode = monitor.metric, monitor.mode
    best = ModelCheckpoint(
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
    every_epoch = ModelCheckpoint(**last, save_on_train_epoch_end=True)
    steps = checkpoint.every_n_train_steps
    every_n_steps = [ModelCheckpoint(**last, every_n_train_steps=steps)] if steps else []
    return [best, *every_n_steps, every_epoch]


@dataclass(frozen=True)
class TrainerJob:
    """A job's Trainer and the callbacks the job reads back: the stop flag, and the best checkpoint (training)."""

    trainer: L.Trainer
    stop: JobControl
    best: ModelCheckpoint | None = None

    @contextlib.contextmanager
    def running(self, resume_hint: str) -> Iterator[None]:
        """Where the job runs `fit` and `test`: a SIGTERM ends it with exit code 143 and `resume_hint`. When it ends,
        each callback with a `job_ended` hook is told (the failure watch stops)."""
        try:
            with exit_when_stopped(self.stop, resume_hint):
                yield
        finally:
            for callback in self.trainer.callbacks:
                getattr(callback, "job_ended", lambda: None)()


def template_callbacks(config: TrainConfig, plan: Plan, run_dir: Path) -> list[L.Callback]:
    """The machinery every training run has, before the user's callbacks. Lightning calls callbacks in list order,
    and this one is what each needs:
    - StepPlan (the LR schedule and the step's seed) before the user's callbacks: LearningRateMonitor logs the LR
      set for the step, and a callback sees (a probe may draw from) the micro-batch's seeded stream;
    - AutoBatchSize before LoopRepairs: the micro-batch is settled before a resume's counters are restated in it;
    - ExactEvalMetrics before the checkpoints, RunFiles and the user's callbacks (EarlyStopping, a search's report,
      which the search adds to each trial's callbacks group): they read eval metrics once they are exact.
    JobControl comes after the user's callbacks (build_trainer): the others finish the batch it stops after.
    engine/tests/test_train_e2e.py checks these rules on a real run's callbacks.
    """
    return [
        StepPlan(
            plan.tf32, plan.channels_last, LRScaling(plan.schedule()), StepSeed(plan.seed, plan.global_batch_size)
        ),
        *settle_named_cap(plan, run_dir),
        ExactEvalMetrics(monitor=config.monitor.metric),
        *checkpoint_callbacks(config.monitor, config.checkpoint),
        LoopRepairs(),
        RunFiles(run_dir / "metrics.json", config.plain, plan.to_dict()),
        *([StopAtPlannedSteps(plan.total_steps)] if plan.manual_optimization else []),
    ]


def settle_named_cap(plan: Plan, run_dir: Path) -> list[L.Callback]:
    """A per-device cap given by name (`data.max_per_device_batch_size=auto`) is settled at the start of fit by the
    callback registered under that name (registry.py): the engine's `auto` is the auto batch size
    (plan/batch_probe.py). A number or no cap: none."""
    name = plan.max_per_device_batch_size
    if not isinstance(name, str):
        return []
    settler = registered("per_device_caps", name)
    if settler is None:
        raise UserError(
            f"data.max_per_device_batch_size={name}: the part that settles it is not installed (no "
            f"scaleup.per_device_caps entry point {name!r} loads; reinstall the engine: pip install -e ./engine); or "
            "give a number"
        )
    return [settler(plan, run_dir / "batch_probe.json")]


def job_watch(world_size: int, hang_timeout_minutes: float | None, timeout_minutes: float | None) -> list[L.Callback]:
    """On several processes, the failure watch's part (registry.py: distributed/watchdog.py's JobWatch), which names a
    rank that fails, hangs or is killed and ends every rank. Its hooks come before JobControl's."""
    if world_size == 1:
        return []
    watch = registered("job_watch", "default")
    if watch is None:
        if rank_zero_only.rank == 0:
            log.warning(
                "the failure watch is not installed (no scaleup.job_watch entry point loads; reinstall the engine: pip "
                "install -e ./engine): a rank that fails, hangs or is killed is not named, and the others wait for it"
            )
        return []
    return [watch(hang_timeout_minutes, timeout_minutes)]


# What build_trainer passes from the topology and the plan in place of the config's values (auto resolved, checked
# by the plan), and the Trainer that refuse_trainer_arguments constructs in their place.
PLANNED = (
    *("accelerator", "devices", "num_nodes", "sync_batchnorm", "precision", "accumulate_grad_batches"),
    "log_every_n_steps",
)
PROBE = {"accelerator": "cpu", "devices": 1, "num_nodes": 1, "logger": False, "callbacks": []}


def check_trainer_arguments(settings: TrainerArgs, *, probe: bool = True) -> L.Trainer | None:
    """Refuse a `trainer.*` value that the run would take silently (check_minimum_length), and with `probe` one that
    lightning.Trainer refuses (refuse_trainer_arguments); returns the Trainer it constructed to probe, or None.

    Lightning checks its arguments when a Trainer is constructed. A run constructs its own right after the plan,
    before the plan is printed and anything starts (build_trainer turns a refusal into the same one line): a run
    passes `probe=False`. A dry run, which plans for devices this machine may not have and fits nothing, probes on
    one CPU process; its plan attaches the module to that Trainer (plan/lr.py base_lrs): still one per job.
    """
    check_minimum_length(settings)
    if not probe:
        return None
    try:
        return probe_trainer(unplanned(settings))
    except Exception:
        refuse_trainer_arguments(settings)
        raise  # refused only with the others' values: Lightning's own message


def refuse_trainer_arguments(settings: TrainerArgs) -> None:
    """Refuse a `trainer.*` value that lightning.Trainer refuses: one UserError `trainer.<key>=<value>: <Lightning's
    message>` (`trainer: <message>` where no key alone is refused). A Trainer is constructed with the config's
    arguments on one CPU process (10-15 ms), the topology and the plan's keys left to the plan; then, where it is
    refused, one per key to name the key."""
    given = unplanned(settings)
    refused = trainer_refusal(given)
    if refused is None:
        return
    for name, value in given.items():
        alone = trainer_refusal({name: value})
        if alone is not None:
            raise UserError(f"trainer.{name}={render(value)}: {first_line(alone)}") from alone
    raise UserError(f"trainer: {first_line(refused)}") from refused


def unplanned(settings: TrainerArgs) -> dict[str, Any]:
    """The `trainer.*` values passed to lightning.Trainer as given: all but the PLANNED keys, which the plan sets."""
    return {name: value for name, value in values(settings).items() if name not in PLANNED}


def check_minimum_length(settings: TrainerArgs) -> None:
    """Refuse a minimum length above the maximum (`trainer.min_epochs` over `max_epochs`, `min_steps` over
    `max_steps`): Lightning takes it and stops at the maximum, silently shorter than asked."""
    for unit in ("epochs", "steps"):
        least, most = getattr(settings, f"min_{unit}"), getattr(settings, f"max_{unit}")
        if least is not None and most not in (None, -1) and least > most:
            raise UserError(
                f"trainer.min_{unit}={least} is above trainer.max_{unit}={most}, which would stop the run first: "
                f"lower trainer.min_{unit} or raise trainer.max_{unit}"
            )


def check_validation_interval(settings: TrainerArgs, plan: Plan) -> None:
    """Refuse a `trainer.val_check_interval` in batches that an epoch does not reach, as Lightning would once fit has
    started: each device's epoch is the plan's steps x accumulation batches (checked per epoch unless
    `trainer.check_val_every_n_epoch=null`)."""
    interval, batches = values(settings).get("val_check_interval"), plan.steps_per_epoch
    if not isinstance(interval, int) or isinstance(interval, bool) or batches is None:
        return
    batches *= plan.accumulate_grad_batches or 1
    if settings.check_val_every_n_epoch is not None and interval > batches:
        raise UserError(
            f"trainer.val_check_interval={interval} is more than the {batches} training batches of an epoch on each "
            f"device: validate every N <= {batches} batches, every share of an epoch (0.5), or every {interval} "
            "batches across epochs with trainer.check_val_every_n_epoch=null"
        )


def trainer_refusal(arguments: dict[str, Any]) -> Exception | None:
    """What constructing a lightning.Trainer with `arguments` on one CPU process raises, or None."""
    try:
        probe_trainer(arguments)
    except Exception as err:
        return err
    return None


def probe_trainer(arguments: dict[str, Any]) -> L.Trainer:
    """A lightning.Trainer with `arguments` on one CPU process. Quiet: no log line or warning (the run's own Trainer
    says them), no cluster detected (a launcher's environment would be read)."""
    drop = logging.Filter("nothing")  # refuses every record, whose logger is never named `nothing`
    rank_zero_module.log.addFilter(drop)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return L.Trainer(**{**PROBE, "plugins": [LightningEnvironment()], **arguments})
    finally:
        rank_zero_module.log.removeFilter(drop)


def on_training_device(callbacks: dict[str, Any] | None, accelerator: str) -> dict[str, Any]:
    """The callbacks group with the training device's type as `device` of each weight-averaging entry (Lightning's
    WeightAveraging or EMAWeightAveraging, a subclass of one such as `callbacks=ema`'s EMA) that names none.

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


def build_trainer(config: TrainConfig, plan: Plan, topology: Topology, strategy: Any, run_dir: Path) -> TrainerJob:
    """A Trainer with the template's callbacks and the user's, the loggers, and the plan's resolved settings."""
    quiet()
    set_tf32(plan.tf32)  # here too: Lightning checks the setting when it sets up the GPU, before any callback runs
    callbacks = template_callbacks(config, plan, run_dir)
    best = callbacks[[type(cb) for cb in callbacks].index(ModelCheckpoint)]  # the first: the best epoch
    with config_errors("callbacks"):
        callbacks += instantiate_each(on_training_device(config.callbacks, topology.accelerator))
    # Lightning refuses a progress bar it was told not to show; and given none, it adds its TQDM bar, which redraws
    # after every step: the default one instead.
    if not config.trainer.enable_progress_bar:
        callbacks = [cb for cb in callbacks if not isinstance(cb, ProgressBar)]
    elif not any(isinstance(cb, ProgressBar) for cb in callbacks):
        callbacks.append(SteadyRichProgressBar(refresh_rate=4))
    bounds = config.strategy.hang_timeout_minutes, config.strategy.timeout_minutes
    callbacks += job_watch(topology.world_size, *bounds)
    stop = JobControl(
        config.checkpoint.dirpath,
        config.strategy.hang_timeout_minutes,
        stop_on_nonfinite_loss=config.stop_on_nonfinite_loss,
    )
    callbacks.append(stop)
    with config_errors("logger"):
        loggers = instantiate_each(config.logger)
    # Lightning refuses an LR monitor with nowhere to log.
    if not loggers:
        callbacks = [cb for cb in callbacks if not isinstance(cb, LearningRateMonitor)]
    require(
        EXACT_EVAL,
        SIGTERM_HANDLER,
        *([EMA_DEVICE] if any(isinstance(cb, WeightAveraging) for cb in callbacks) else []),
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
        **planned_length(plan),
    }
    plugins: list[Any] = [AtomicCheckpointIO(), *cluster_plugins()]  # a PyTorchJob's ranks: distributed/clusters.py
    # A strategy that states how the Trainer takes the precision has its say (FSDP's: float64 as a plugin).
    if (precision_of := getattr(strategy, "trainer_precision", None)) is not None:
        trainer_kwargs["precision"], precision_plugins = precision_of(plan.precision)
        plugins += precision_plugins
    # The run's one Trainer, constructed before the plan is printed: Lightning checks the config's `trainer.*` values
    # here. A value it refuses is one line (refuse_trainer_arguments names it); any other failure is a bug.
    try:
        trainer = L.Trainer(
            **trainer_kwargs,
            strategy=strategy,
            callbacks=callbacks,
            logger=loggers or False,
            plugins=plugins,
            default_root_dir=run_dir,
            use_distributed_sampler=False,  # the data module's samplers split the data: Lightning adds none
        )
    except Exception:
        refuse_trainer_arguments(config.trainer)
        raise
    install_fit_loop_fixes(trainer)  # after require(EPOCH_END_RESUME)
    if trainer.is_global_zero:
        remove_interrupted_writes(config.checkpoint.dirpath)
    return TrainerJob(trainer, stop, best)


def planned_length(plan: Plan) -> dict[str, int]:
    """Under manual optimization, the Trainer's length in epochs only (the last one cut short by StopAtPlannedSteps):
    Lightning's `max_steps` would count every optimizer.step() call, the plan's `total_steps` counts global batches."""
    if not plan.manual_optimization or not plan.steps_per_epoch:
        return {}
    return {"max_steps": -1, "max_epochs": math.ceil(plan.total_steps / plan.steps_per_epoch)}


HANG_TIMEOUT_MINUTES = group_values("strategy/_base")["hang_timeout_minutes"]  # eval.py's: it has no strategy section


def build_eval_trainer(topology: Topology, precision: Any, plan: Plan, run_dir: Path, progress_bar: bool) -> TrainerJob:
    """The Trainer of `eval.py`: the checkpoint's own speed settings, exact metrics into metrics.json, no logger."""
    quiet()
    require(EXACT_EVAL, SIGTERM_HANDLER)
    stop = JobControl(hang_timeout_minutes=HANG_TIMEOUT_MINUTES)
    tf32, channels_last = plan.tf32, plan.channels_last  # as trained
    set_tf32(tf32)  # here too: Lightning checks the setting when it sets up the GPU, before any callback runs
    callbacks = [StepPlan(tf32, channels_last), ExactEvalMetrics(), RunFiles(run_dir / "metrics.json")]
    callbacks += [*job_watch(topology.world_size, HANG_TIMEOUT_MINUTES, None), stop]
    trainer = L.Trainer(  # every value checked before (the topology, the precision): what fails here is a bug
        accelerator=topology.accelerator,
        devices=topology.devices,
        num_nodes=topology.num_nodes,
        precision=precision,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=progress_bar,
        default_root_dir=run_dir,
        use_distributed_sampler=False,  # the data module's samplers split the data: Lightning adds none
    )
    return TrainerJob(trainer, stop)
