"""Resuming a run: which checkpoint `ckpt_path` names, and whether it can continue under this plan.

Everything here runs before anything is written, so a refused resume leaves the run directory as it was.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.utilities import rank_zero_only

from scaleup.checkpoints.io import exists, find_checkpoint, is_url, load_checkpoint, strip_wrapper_prefixes
from scaleup.config.plain import flatten
from scaleup.config.project import project_packages
from scaleup.config.stored import stored_model, stored_plan
from scaleup.data.samplers import GlobalBatchSampler, resumed_steps
from scaleup.distributed.run_dir import is_rank_zero_from_env
from scaleup.errors import UserError
from scaleup.plan.progress import checkpoint_steps
from scaleup.plan.resolve import Plan

if TYPE_CHECKING:
    from scaleup.config.typed import TrainConfig

log = logging.getLogger("scaleup")

# What a run that trained leaves besides its checkpoints. (Not plan.json: this run's rank 0 may have written it
# already when another rank looks.)
RUN_FILES = ("metrics.json",)
EVENT_FILES = "events.out.tfevents.*"  # TensorBoard's, under <run dir>/tensorboard/ (or a logger's own folder)
TEST_PREFIX = "test/"  # the final test's metrics: their presence in metrics.json says that the test ran to its end
REPLACED = "replaced"  # fresh_start=true moves an earlier run's files to <run dir>/replaced/<n>/
KEPT_IN_PLACE = (".hydra", REPLACED)  # what a fresh start leaves, besides the job's log (which Hydra has open)


def holds_test_results(path: Path) -> bool:
    """Whether `path` (a run's metrics.json) holds the final test's metrics."""
    return path.is_file() and any(name.startswith(TEST_PREFIX) for name in json.loads(path.read_text()))


def checkpoint_files(checkpoint_dir: str) -> list[str]:
    """The checkpoints in `checkpoint_dir` (a local folder or a URL), sharded ones (folders) included."""
    fs = get_filesystem(checkpoint_dir)
    return sorted(str(path) for path in fs.glob(f"{checkpoint_dir.rstrip('/')}/*.ckpt"))


def trained_files(run_dir: Path, checkpoint_dir: str | None) -> list[str]:
    """What only a run that started training writes, found in `run_dir` and `checkpoint_dir` (None: not looked in):
    checkpoints (also SLURM's hpc_ckpt_N.ckpt), metrics.json and TensorBoard event files, named relative to `run_dir`
    where they are in it. Not plan.json, config.yaml or train.log: a dry run writes them too, and this very run's
    rank 0 may have written them when another rank looks (torchrun starts every rank at once). An earlier run moved
    aside by fresh_start=true is not counted."""
    checkpoints = checkpoint_files(checkpoint_dir) if checkpoint_dir is not None else []
    found = [*checkpoints, *map(str, run_dir.glob("hpc_ckpt_*.ckpt"))]
    found += [str(run_dir / name) for name in RUN_FILES if (run_dir / name).is_file()]
    found += [str(p) for p in sorted(run_dir.rglob(EVENT_FILES)) if REPLACED not in p.relative_to(run_dir).parts]
    return [path.removeprefix(f"{run_dir}/") for path in found]


def check_run_dir(config: TrainConfig, run_dir: Path) -> None:
    """A run directory that holds a run is resumed (`ckpt_path=last`), or started over with `fresh_start=true` (its
    files moved aside, nothing deleted); a new run there without either is refused before anything is written: it
    would replace the earlier run's last.ckpt, metrics.json and plan.json, and mix their checkpoints and events.
    Every rank decides alike, from files that only a run that trained writes (`trained_files`); rank 0 moves."""
    if config.fresh_start and config.ckpt_path is not None:
        raise UserError(
            f"fresh_start=true starts a run from scratch, ckpt_path={config.ckpt_path} continues one: pass one of them"
        )
    if config.ckpt_path is not None:
        return  # resumes this run, or continues in it from the checkpoint named (resolve_ckpt_path)
    # A dry run plans a cluster's job on a laptop: its files here only, not the cluster's bucket (what it replaces).
    remote = config.dry_run and is_url(config.checkpoint.dirpath)
    found = trained_files(run_dir, None if remote else config.checkpoint.dirpath)
    if not found:
        return
    shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    if config.dry_run:
        raise UserError(
            f"{run_dir} holds a run ({shown}), whose plan.json and config.yaml a dry run would replace: pass "
            "hydra.run.dir=<another directory> for the dry run"
        )
    if not config.fresh_start:
        raise UserError(
            f"{run_dir} holds a run ({shown}): resume it with ckpt_path=last, or start a new run in another directory "
            f"with hydra.run.dir=<new dir> (fresh_start=true starts over here, moving its files to {run_dir}/"
            f"{REPLACED}/<n>/ first)"
        )
    if is_rank_zero_from_env():
        move_aside(run_dir, config.checkpoint.dirpath)


def move_aside(run_dir: Path, checkpoint_dir: str) -> Path:
    """Move the earlier run's files in `run_dir` into `<run_dir>/replaced/<n>/` (the next free n), all but the job's
    log, which the starting run appends to, and Hydra's record of the command (`.hydra/`, written already); returns
    that folder. Checkpoints outside `run_dir` cannot move with it: refused."""
    outside = [path for path in checkpoint_files(checkpoint_dir) if not path.startswith(f"{run_dir}/")]
    if outside:
        raise UserError(
            f"fresh_start=true moves the earlier run's files within {run_dir}, but its checkpoints are in "
            f"{checkpoint_dir} ({', '.join(outside[:3])}): move or delete them, or pass checkpoint.dirpath=<another "
            "location>"
        )
    replaced = run_dir / REPLACED
    number = 1 + max((int(p.name) for p in replaced.glob("*") if p.name.isdigit()), default=0)
    target = replaced / str(number)
    target.mkdir(parents=True)
    for path in sorted(run_dir.iterdir()):
        if path.name not in KEPT_IN_PLACE and not (path.is_file() and path.suffix == ".log"):
            shutil.move(path, target / path.name)
    log.warning(f"fresh_start=true: moved the earlier run's files in {run_dir} to {target}")
    return target


@dataclass(frozen=True)
class ResumePoint:
    """Where the run starts: from scratch (`path` None), from a checkpoint, or, for a run that trained to its end
    (`finished`), at the test of its best checkpoint; or nowhere, for one whose test ran to its end too (`tested`)."""

    path: Path | str | None = None
    step: int = 0
    finished: bool = False
    best: str = ""  # the best checkpoint, to test when `finished`
    tested: bool = False  # `finished`, and metrics.json holds its test's results: nothing is left to do


def resolve_ckpt_path(ckpt_path: str | None, checkpoint_dir: str, run_dir: Path) -> Path | str | None:
    """`last` is the run's newest checkpoint: `<checkpoint.dirpath>/last.ckpt`, or the hpc_ckpt_N.ckpt that
    Lightning saves in the run directory on SLURM's pre-emption signal if that is newer. With none yet it starts
    from scratch, so one command both starts a job and resumes it after a restart; a directory that already
    holds another run's files but no last.ckpt is refused. Anything else must be a checkpoint file (or a URL
    such as s3://bucket/run/last.ckpt, read through fsspec), or what `find_checkpoint` finds from a directory or a
    glob."""
    if ckpt_path != "last":
        return None if ckpt_path is None else find_checkpoint(ckpt_path, prefer="last")
    last = f"{checkpoint_dir.rstrip('/')}/last.ckpt"
    if is_url(last):
        return last if exists(last) else None
    candidates = [p for p in [Path(last), *run_dir.glob("hpc_ckpt_*.ckpt")] if exists(p)]
    if candidates:
        return max(candidates, key=lambda p: p.stat().st_mtime_ns)
    earlier = [name for name in RUN_FILES if (run_dir / name).is_file()]
    earlier += [path.removeprefix(f"{run_dir}/") for path in checkpoint_files(checkpoint_dir)]
    if earlier:
        raise UserError(
            f"ckpt_path=last: {run_dir} holds an earlier run ({', '.join(earlier)}) but no {last} to resume from; "
            "pass another hydra.run.dir for a new run, or ckpt_path=<one of its checkpoints> to continue from it"
        )
    log.warning(
        f"ckpt_path=last: no checkpoint in {checkpoint_dir} yet, starting a new run there. To resume another run, "
        "pass its directory: hydra.run.dir=<run dir> (runs are under outputs/train/ unless paths.log_dir says else)"
    )
    return None


def resume_point(
    ckpt_path: str | None,
    config: TrainConfig,
    plan: Plan,
    model: L.LightningModule,
    datamodule: L.LightningDataModule,
    run_dir: Path,
) -> ResumePoint:
    """Open the checkpoint up front (clear errors, no traceback), refuse what cannot continue, report what changed."""
    path = resolve_ckpt_path(ckpt_path, config.checkpoint.dirpath, run_dir)
    if path is None:
        return ResumePoint()
    checkpoint = load_checkpoint(path, weights=False)  # a sharded one: its shapes, not its tensors
    if "state_dict" not in checkpoint:
        raise UserError(
            f"{path} holds weights only (a plain state_dict, e.g. an export), not a run to resume: ckpt_path takes a "
            f"checkpoint that train.py wrote, e.g. <run dir>/checkpoints/last.ckpt; a new run starts from these "
            f"weights with init.weights={path}"
        )
    step = checkpoint_steps(checkpoint, manual_optimization=plan.manual_optimization)
    check_same_network(path, checkpoint, stored_model(checkpoint, project_packages(config.plain)), config.model, model)
    previous = stored_plan(checkpoint)  # None: not trained by scaleup's train.py
    check_same_global_batch(path, previous, step, plan)
    check_same_trainable(path, checkpoint, previous, plan, config.init.freeze)
    check_same_order(path, checkpoint, step, datamodule, plan)
    stopped_early = early_stop_reason(checkpoint)
    if ckpt_path == "last" and (step == plan.total_steps or stopped_early):
        # Trained to its end: what is left is the test, unless it ran to its end too (a requeue of a finished job).
        tested = holds_test_results(run_dir / "metrics.json")
        best = best_checkpoint(checkpoint, config.monitor.metric, path)
        return ResumePoint(path, step, finished=True, best=best, tested=tested)
    if stopped_early:
        raise UserError(
            f"{path} is from a run that early stopping ended {stopped_early}; there is nothing to resume. To train "
            f"on, start a new run, e.g. from these weights (init.weights={path}) or with a larger "
            "callbacks.early_stopping.patience"
        )
    if step >= plan.total_steps:
        raise UserError(
            f"{path} is at step {step} (epoch {checkpoint.get('epoch')}), already at or past this plan's "
            f"{plan.total_steps} steps; raise trainer.max_epochs or trainer.max_steps to train further"
        )
    if rank_zero_only.rank == 0:
        log_changes(path, previous, plan)
    return ResumePoint(path, step)


def check_same_network(
    path: Path | str, checkpoint: dict[str, Any], stored_cfg: dict[str, Any], model_cfg: dict[str, Any], model: Any
) -> None:
    """Another network is one whose weights have other names or shapes; the `model` configs' differences (the
    checkpoint's stored one, and this run's) say why."""
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    stored_shapes = {name: tuple(t.shape) for name, t in strip_wrapper_prefixes(checkpoint["state_dict"]).items()}
    if stored_shapes == shapes:
        return
    changed = sorted(name for name in stored_shapes | shapes if stored_shapes.get(name) != shapes.get(name))
    if not stored_cfg:  # no model config to compare: a checkpoint of plain Lightning or of other code
        raise UserError(
            f"{path} was not written by this template's train.py (it stores no model config) and its weights do "
            f"not fit this model ({len(changed)} tensors differ, e.g. {changed[0]}: {stored_shapes.get(changed[0])} "
            f"there, {shapes.get(changed[0])} here): start a new run from its weights with init.weights={path} "
            "(init.skip naming what is new: docs/finetuning.md)"
        )
    before, now = flatten(stored_cfg), flatten(model_cfg)
    diffs = [
        f"model.{k}={before.get(k)} (now {now.get(k)})" for k in sorted(before | now) if before.get(k) != now.get(k)
    ]
    raise UserError(
        f"{path} was trained with another network: {', '.join(diffs) or f'weights {changed[:3]} differ'}; "
        f"resume with the same model settings, or start a new run from its weights: init.weights={path} (with "
        "init.skip naming what is new: docs/finetuning.md)"
    )


def check_same_global_batch(path: Path | str, previous: Plan | None, step: int, plan: Plan) -> None:
    """The steps taken, the epoch they are in and the LR schedule all count optimizer steps of the checkpoint's
    global batch: a resume with another one would plan a run that does not happen."""
    if previous is None or previous.global_batch_size == plan.global_batch_size:
        return
    before = previous.global_batch_size
    raise UserError(
        f"{path} trained {step} steps with a global batch of {before} ({step * before} samples), this run's is "
        f"{plan.global_batch_size}: its steps, epoch and LR schedule count batches of {before}. Resume with "
        f"data.global_batch_size={before} data.per_device_batch_size=null (any device count keeps it), or start a "
        f"new run from these weights: init.weights={path}"
    )


def check_same_trainable(
    path: Path | str, checkpoint: dict[str, Any], previous: Plan | None, plan: Plan, freeze: list[str | int]
) -> None:
    """The optimizer's state is per parameter it trained: a resume that trains others (another init.freeze) would
    give it to the wrong ones (torch refuses most such states inside fit, with a traceback)."""
    if previous is None or previous.trainable_parameters in (None, plan.trainable_parameters):
        return
    then = checkpoint["scaleup"].get("config", {}).get("init", {}).get("freeze", [])
    listed = [f"[{','.join(map(str, patterns))}]" for patterns in (then, freeze)]
    fix = f"resume with init.freeze={listed[0]}" if then != freeze else "resume with the same parameters frozen"
    raise UserError(
        f"{path} trained {previous.trainable_parameters:,} parameters (init.freeze={listed[0]}), this run would "
        f"train {plan.trainable_parameters:,} (init.freeze={listed[1]}), and the optimizer's state is for those it "
        f"trained: {fix}, or start a new run from its weights: init.weights={path}"
    )


def check_same_order(
    path: Path | str, checkpoint: dict[str, Any], step: int, datamodule: L.LightningDataModule, plan: Plan
) -> None:
    """A mid-epoch checkpoint continues only in the order that took its steps: the train loader would refuse
    another one inside fit (`samplers.resumed_steps`); refused here, before plan.json and config.yaml are written."""
    splits = getattr(datamodule, "splits", None) or {}
    if "train" not in splits:
        return
    if hasattr(datamodule, "train_sampler"):  # the DataModule's own order (sharded data: the window shuffle)
        sampler = datamodule.train_sampler(plan.global_batch_size, 1, 0)
    else:
        sampler = GlobalBatchSampler(splits["train"], plan.global_batch_size, num_replicas=1, rank=0, seed=0)
    if 0 < step - checkpoint.get("epoch", 0) * sampler.steps_per_epoch < sampler.steps_per_epoch:
        resumed_steps(checkpoint.get(type(datamodule).__qualname__), str(path), checkpoint["epoch"], step, sampler)


def early_stop_reason(checkpoint: dict[str, Any]) -> str:
    for name, state in checkpoint.get("callbacks", {}).items():
        if name.startswith("EarlyStopping") and state.get("stopping_reason_message"):
            return f"at epoch {state['stopped_epoch']} ({state['stopping_reason_message'].strip()})"
    return ""


def best_checkpoint(checkpoint: dict[str, Any], monitor: str, path: Path | str) -> str:
    """The best checkpoint by `monitor` (monitor.metric) that the run recorded, or `path` itself if it is gone."""
    for name, state in checkpoint.get("callbacks", {}).items():
        best = state.get("best_model_path") if name.startswith("ModelCheckpoint") else None
        if best and state.get("monitor") == monitor and exists(best):
            return str(best)
    log.warning(f"the run's best checkpoint by {monitor} is gone: testing {path}")
    return str(path)


def shown(value: Any) -> str:
    """A plan value in the resume log: an empty one (e.g. no FSDP sharding on one device) as `none`."""
    if isinstance(value, tuple | list):
        return ", ".join(map(str, value)) or "none"
    if isinstance(value, dict):  # each param group's base LR
        return "{" + ", ".join(f"{key}: {item}" for key, item in value.items()) + "}"
    return "none" if value in (None, "") else str(value)


# What a resume does not compare: the launch (a restarted torchrun counts up), the split sizes, the code of the SyncBN
# rule (its setting and outcome are compared), and BatchNorm's fields that init.* sets after this comparison
# (finetune.Start.begin, which adds the init record then: a record only one plan holds is not compared).
NOT_COMPARED = (
    "dataset_sizes",
    "sync_batchnorm_rule",
    "launcher_kind",
    "launcher_restarts",
    "launcher_job",
    "trained_bn_batch_size",
    "batchnorm_frozen",
    "batchnorm_frozen_module",
    "batchnorm_unfrozen",
)


# What a resume on other devices, nodes or another strategy changes by design: how the same global batch is split
# and computed (the promise: the same results on any topology), and how often the run logs.
SAME_TRAINING = (
    "world_size",
    "num_nodes",
    "devices",
    "accelerator",
    "per_device_batch_size",
    "accumulate_grad_batches",
    "max_per_device_batch_size",
    "bn_batch_size",
    "sync_batchnorm",
    "strategy",
    "tf32",
    "channels_last",
    "log_every_n_steps",
)
# What a resume that trains further (or less: trainer.max_epochs, max_steps) asks for on purpose: said, not warned.
RUN_LENGTH = ("total_steps",)
# The plan's LR fields: a run reads them when fit starts (Plan.base_lrs), and compares them then (log_lr_changes).
LR_FIELDS = ("base_lrs", "base_lr", "lr")


def log_changes(path: Path | str, previous: Plan | None, plan: Plan) -> None:
    """The plan's changes since the checkpoint: those of another topology or run length in the resume's line; any
    other one (an override of the run's start left out, such as its LR) changes the recipe the run trained with, in a
    warning."""
    skipped = set(NOT_COMPARED)
    if plan.max_per_device_batch_size == "auto":  # settled again at the start of fit
        skipped |= {"per_device_batch_size", "accumulate_grad_batches", "bn_batch_size"}
    if plan.base_lrs is None:  # known when fit starts
        skipped |= set(LR_FIELDS)
    changed = plan_changes(previous, plan, skipped)
    said = {*SAME_TRAINING, *RUN_LENGTH} | {key for key in changed if of_a_record(key)}
    moved = [change for key, change in changed.items() if key in said]
    log.info(f"resuming from {path}" + (f"; changed since: {', '.join(moved)}" if moved else ""))
    warn_recipe_changes(path, [change for key, change in changed.items() if key not in said])


def log_lr_changes(path: Path | str, previous: Plan | None, plan: Plan) -> None:
    """The recipe warning for the plan's LR fields, once fit has read them (callbacks/run_files.py)."""
    changed = plan_changes(previous, plan, set(compared(plan)) - set(LR_FIELDS))
    warn_recipe_changes(path, list(changed.values()))


def compared(plan: Plan | None) -> dict[str, Any]:
    """The plan's values as a resume compares them: its fields, and each record's as `<record>.<field>` (its tuples
    as lists: a stored plan's record holds JSON's)."""
    if plan is None:
        return {}
    values = plan.to_dict()
    for record in plan.records:
        fields = json.loads(json.dumps(values.pop(record.key)))
        values.update({f"{record.key}.{name}": value for name, value in fields.items()})
    return values


def of_a_record(key: str) -> bool:
    """Whether `key` of `compared` is a record's field (`<record>.<field>`; the plan's own fields have no dot). An
    extra's record (strategy=fsdp's sharding) says how the run computes the same training, as SAME_TRAINING does: a
    change of one of its fields is said in the resume's line (`sharding.mesh 4 -> 2, 2`)."""
    return "." in key


def plan_changes(previous: Plan | None, plan: Plan, skipped: set[str]) -> dict[str, str]:
    """`<key> <before> -> <now>` for each key of the plan, but `skipped`, whose value changed since `previous`."""
    before = compared(previous)
    return {
        key: f"{key} {shown(before[key])} -> {shown(value)}"
        for key, value in compared(plan).items()
        if key in before and before[key] != value and key not in skipped
    }


def warn_recipe_changes(path: Path | str, recipe: list[str]) -> None:
    """One warning naming the `recipe` changes (`<key> <before> -> <now>`) of a resume from `path`, if any."""
    if recipe:
        log.warning(
            f"the resume changes the recipe {path} trained with: {', '.join(recipe)}. If the run started with "
            "overrides, pass them again (this run's config.yaml and plan.json now hold the new values)"
        )
