"""The places where the template works around Lightning (or torch, torchmetrics) for correct results.

Each entry below was measured on Lightning 2.6.6 with torch 2.14.1. Its docstring gives that version, the reason in
one line, and the name of its canary in tests/test_lightning_workarounds.py. A canary runs plain Lightning WITHOUT
the workaround and asserts the behaviour that made the workaround necessary (or the private API it relies on).
The speed-only fast paths are in fast_paths.py; what each entry needs of private code is checked in gates.py.

Private names are imported where they are used, never when this module is: a Lightning release without one
breaks no import. Where a public fallback gives the same result, it runs instead; where none does, the job that
needs the workaround refuses to start in one line (`gates.require`).

When a canary fails after an upgrade, Lightning changed that behaviour: delete that workaround (and its canary),
use Lightning's own behaviour or public API instead, and run the tests that name the entry.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import typing
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.optim import Optimizer
from torchmetrics import Metric

from scaleup.compat import fast_paths

log = logging.getLogger("scaleup")

# --- Warnings --------------------------------------------------------------------------------------------------------

UNRESUMABLE_LOADER_WARNING = "You're resuming from a checkpoint that ended before the epoch ended"


def ignore_unresumable_loader_warning() -> None:
    """Silences Lightning's warning that a mid-epoch resume will not resume the train loader.

    Lightning 2.6.6. Reason: our GlobalBatchSampler skips the steps a mid-epoch checkpoint already took, but
    Lightning warns for every loader that is not `_Stateful` (has no state_dict/load_state_dict).
    Canary: test_mid_epoch_resume_warns_for_a_loader_without_state_dict.
    (A public alternative: a train DataLoader with `state_dict()`/`load_state_dict()`, which Lightning treats as
    resumable and stores in the checkpoint; that is a change to data/datamodule.py, not made here.)
    """
    warnings.filterwarnings("ignore", message=UNRESUMABLE_LOADER_WARNING)


# --- Launch ----------------------------------------------------------------------------------------------------------


@functools.cache
def _clean_exit_launcher_class() -> type:
    """Lightning's spawn launcher, whose workers run `on_exit` (leave the process group together) before they exit.

    Lightning 2.6.6. Reason: Lightning's spawn worker function returns with the process group still up and has no
    hook after it; a worker that exits while its peer still holds gloo connections can abort ("terminate called
    without an active exception", seen at the end of a spawned test). Subclasses a private Lightning class, so the
    class is made when a spawn run needs it (gates.SPAWN_LAUNCHER checks it first), under this module's name, which
    pickle finds through the module's `__getattr__` in the spawned workers too.
    Canary: test_spawn_worker_leaves_the_process_group_up.
    """
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    class CleanExitLauncher(_MultiProcessingLauncher):
        def __init__(self, strategy: Any, start_method: str, on_exit: Callable[[], None]) -> None:
            super().__init__(strategy, start_method=start_method)
            self.on_exit = on_exit  # a module-level function: spawn pickles it into every worker

        def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
            super()._wrapping_function(*args, **kwargs)
            self.on_exit()

    CleanExitLauncher.__module__, CleanExitLauncher.__qualname__ = __name__, "CleanExitLauncher"
    return CleanExitLauncher


def __getattr__(name: str) -> Any:
    if name == "CleanExitLauncher":
        return _clean_exit_launcher_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class SpawnDDPStrategy(DDPStrategy):
    """DDPStrategy(start_method="spawn") with the CleanExitLauncher (same Lightning version, reason and canary)."""

    def __init__(self, *, on_exit: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(start_method="spawn", **kwargs)
        self.on_exit = on_exit

    def _configure_launcher(self) -> None:
        self._launcher = _clean_exit_launcher_class()(self, self._start_method, self.on_exit)


def keep_sigterm_handler(trainer: L.Trainer, install: Callable[[], None]) -> None:
    """Calls `install` (which puts our SIGTERM handler back) right after Lightning registers its own, as each of
    `trainer`'s stages starts.

    Lightning 2.6.6. Reason: the private `_SignalConnector.register_signal_handlers` puts Lightning's SIGTERM
    handler (a broadcast inside the handler, a stop of its own rank alone) in front of ours after `setup`, and
    a stage's first callback hook comes only after the process group's barrier and the loaders' setup: a signal
    in between would reach Lightning's. Its SIGUSR1 handler (SLURM's requeue) is left as it is.
    Canary: test_lightning_registers_its_own_sigterm_handler_after_setup.
    """
    connector = trainer._signal_connector
    register = connector.register_signal_handlers

    def register_then_install() -> None:
        register()
        install()

    connector.register_signal_handlers = register_then_install


# --- Optimizers ------------------------------------------------------------------------------------------------------


def parse_configure_optimizers(returned: Any) -> tuple[list[Optimizer], list[Any]]:
    """(optimizers, LR schedulers) from anything `configure_optimizers` may return, parsed by Lightning's own code.

    Lightning 2.6.6. Reason: Lightning has no public parser of the return formats it accepts, and the plan reads
    the LRs before any Trainer exists; this calls the private `lightning.pytorch.core.optimizer._configure_optimizers`
    and, where that is gone, parses the documented formats itself (an optimizer, a list of them, a dict with
    "optimizer" and "lr_scheduler", a list of such dicts, or (optimizers, schedulers)).
    Canary: test_private_configure_optimizers_parses_every_return_format.
    """
    try:
        from lightning.pytorch.core.optimizer import _configure_optimizers

        optimizers, schedulers, _ = _configure_optimizers(returned)
    except ImportError:
        return documented_formats(returned)
    return optimizers, schedulers


def documented_formats(returned: Any) -> tuple[list[Optimizer], list[Any]]:
    """The return formats of `configure_optimizers` that Lightning's documentation lists."""
    if isinstance(returned, Optimizer):
        return [returned], []
    if isinstance(returned, dict):
        return [returned["optimizer"]], [returned["lr_scheduler"]] if "lr_scheduler" in returned else []
    if isinstance(returned, tuple) and len(returned) == 2 and all(isinstance(part, list) for part in returned):
        return list(returned[0]), list(returned[1])
    parsed = [documented_formats(item) for item in returned]
    return [o for optimizers, _ in parsed for o in optimizers], [s for _, schedulers in parsed for s in schedulers]


# Lightning 2.6's `_PRECISION_INPUT`, spelled out.
PRECISIONS_2_6 = (
    "transformer-engine", "transformer-engine-float16", "16-true", "16-mixed", "bf16-true", "bf16-mixed", "32-true",
    "64-true", 64, 32, 16, "64", "32", "16", "bf16",
)  # fmt: skip

# --- Logging steps and precisions ------------------------------------------------------------------------------------


def is_logging_step(trainer: L.Trainer) -> bool:
    """Whether Lightning hands this training step's values to the loggers (every `log_every_n_steps` steps).

    Lightning 2.6.6. Reason: Lightning keeps this rule in the private `trainer._logger_connector.should_update_logs`
    and exposes no public test; reading it there keeps the per-step metrics and the progress bar in step with it.
    Canary: test_should_update_logs_follows_log_every_n_steps. Where that is gone, every step counts as one (the
    loggers still write only theirs: the same curves, at a few us more a step).
    """
    connector = getattr(trainer, "_logger_connector", None)
    return getattr(connector, "should_update_logs", True) or bool(trainer.fast_dev_run)


def lightning_precisions() -> tuple[str | int, ...]:
    """Every `Trainer(precision=...)` spelling Lightning accepts (64-true, bf16-mixed, 16, ...).

    Lightning 2.6.6. Reason: the list lives only in the private type `lightning.fabric.connector._PRECISION_INPUT`
    (a Union of Literals); the config schema checks `trainer.precision` against it.
    Canary: test_private_precision_spellings_include_the_templates. Where that type is gone, Lightning 2.6's list.
    """
    try:
        from lightning.fabric.connector import _PRECISION_INPUT
    except ImportError:
        return PRECISIONS_2_6

    def literals(hint: Any) -> tuple[Any, ...]:
        return tuple(v for arg in typing.get_args(hint) for v in (literals(arg) if typing.get_args(arg) else (arg,)))

    return literals(_PRECISION_INPUT)


# --- Metric updates --------------------------------------------------------------------------------------------------


class LeanUpdateMetric(Metric):
    """A torchmetrics Metric whose `update` runs without torchmetrics' per-call wrapper work.

    torchmetrics 1.9.0. Reason: `Metric._wrap_update` wraps every `update` in a grad-mode switch and two attribute
    writes through `nn.Module.__setattr__` (each an isinstance check against Parameter and Buffer in Python): 36
    Python calls, about 5 us, per update, and a training step of the classifier makes four. Subclasses detach what
    they add to their states, so the grad-mode switch has nothing to do, and they hold no list states (which the
    wrapper may move to the CPU); the update count and the cleared `compute()` cache are kept as torchmetrics keeps
    them. Canary: test_torchmetrics_wraps_update_through_wrap_update. A fast path: only inside a template job
    (`fast_paths.active()`), and only while the states it writes are where torchmetrics 1.9 keeps them.
    """

    def _wrap_update(self, update: Callable[..., None]) -> Callable[..., None]:
        wrapped = super()._wrap_update(update)  # torchmetrics' own, for outside a job

        @functools.wraps(update)
        def counted_update(*args: Any, **kwargs: Any) -> None:
            state = self.__dict__  # where nn.Module.__setattr__ puts plain values
            if not fast_paths.active() or "_update_count" not in state:
                return wrapped(*args, **kwargs)
            state["_computed"] = None
            state["_update_count"] += 1
            update(*args, **kwargs)

        return counted_update


# --- Checkpoints between epochs --------------------------------------------------------------------------------------


class LeanModelCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint, returning at once from a training batch's end when it has no trigger there.

    Lightning 2.6.6. Reason: `ModelCheckpoint.on_train_batch_end` first works out whether the trainer's state would
    allow a save (fast_dev_run, the stage as an enum comparison, sanity checking, the step last saved) and reads the
    clock, and only then finds that neither `every_n_train_steps` nor `train_time_interval` is set: about 40 Python
    calls per step, 40 us in a training step on a CPU, for each of the template's two checkpoints, which save at
    epoch ends. With a step or time trigger it runs Lightning's own check. Reads the private trigger attributes
    Lightning sets in `__init__` (`_every_n_train_steps` is 0 when unset); a fast path, only inside a template job and
    while those attributes exist.
    Canary: test_model_checkpoint_checks_the_trainer_state_on_every_batch.
    """

    @property
    def state_key(self) -> str:
        # Lightning's own key (`ModelCheckpoint{...}`), so checkpoints resume across this class and Lightning's.
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        untriggered = getattr(self, "_every_n_train_steps", 1) < 1 and getattr(self, "_train_time_interval", 0) is None
        if untriggered and fast_paths.active():
            return
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)


# --- TensorBoard -----------------------------------------------------------------------------------------------------


def add_summaries(logger: Any, summaries: list[Any], step: int) -> None:
    """Write raw Summary protos (TensorBoard's HParams) into a TensorBoardLogger's event file, and flush.

    Lightning 2.6.6, torch 2.14.1. Reason: `TensorBoardLogger.log_hyperparams(params, metrics)` also writes each
    metric as a scalar (a second point on every curve), and torch's SummaryWriter takes summaries only through its
    private `_get_file_writer()` (which also reopens a writer Lightning closed after fit).
    Canary: test_log_hyperparams_with_metrics_adds_a_scalar_point. Where that is gone, the HParams tab is not
    written, with one warning (the scalars and metrics.json are).
    """
    get_writer = getattr(logger.experiment, "_get_file_writer", None)
    if get_writer is None:
        log.warning("TensorBoard's HParams tab is not written: torch's SummaryWriter has no _get_file_writer")
        return
    writer = get_writer()
    for summary in summaries:
        writer.add_summary(summary, step)
    writer.flush()


# --- EMA -------------------------------------------------------------------------------------------------------------


class EMA(EMAWeightAveraging):
    """EMAWeightAveraging with two fixes for how this template runs it.

    - The average lives on the training device. Lightning 2.6.6. Reason: Lightning builds the average in `setup`,
      before the strategy moves the model to its device, on `pl_module.device` unless the private `_device` is
      set; by default it would stay on the CPU and every step would copy all weights across.
      Canary: test_ema_average_is_built_before_the_model_moves_to_its_device.
    - Testing a checkpoint after `fit` tests the averaged weights. Lightning 2.6.6. Reason: Lightning swaps the
      training weights back in from `current_model_state` whenever its average still exists, which it does after
      `fit`. Canary: test_ema_testing_a_checkpoint_after_fit_loads_the_training_weights.
    """

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._device is None:
            self._device = trainer.strategy.root_device
        super().setup(trainer, pl_module, stage)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn == "fit":  # resume: restore the average and the training weights
            super().on_load_checkpoint(trainer, pl_module, checkpoint)


# --- Loop state in checkpoints ---------------------------------------------------------------------------------------


class EpochProgressRepair(Callback):
    """Repairs the epoch counter of checkpoints that Lightning writes inconsistently.

    Lightning 2.6.6. Reason: after resuming from a checkpoint saved at the last batch of an epoch, Lightning starts
    the next epoch without counting it as started in `epoch_progress`; a checkpoint saved inside that epoch then
    looks, on the next resume, like the epoch before it, and Lightning trains the whole epoch again (measured: 32
    steps instead of 24 after two such resumes). A checkpoint written inside `on_train_batch_end` always belongs
    to a started epoch: this marks it so before Lightning restores its loops.
    Canary: test_resume_after_an_epoch_end_checkpoint_leaves_the_epoch_unstarted.
    """

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
        batches = fit_loop.get("epoch_loop.batch_progress", {}).get("current", {})
        epochs = fit_loop.get("epoch_progress")
        saved_inside_batch_end = batches.get("completed", 0) < batches.get("ready", 0)
        if epochs and saved_inside_batch_end and epochs["current"]["ready"] == epochs["current"]["completed"]:
            for counts in (epochs["current"], epochs["total"]):
                counts["ready"] = counts["started"] = counts["completed"] + 1


class LoaderWorkersStop(Callback):
    """Stops the persistent loader workers at once when fit, validate or test ends in an error.

    Lightning 2.6.6, torch 2.14.1. Reason: after an error, Lightning's teardown resets the failing loop's loaders
    only: an error in validation inside fit leaves the training loader's persistent workers running (the DataLoader
    keeps its iterator in `_iterator`); the garbage collector reclaims them later, in a cycle whose
    queues it may have closed first, and torch then waits 5 s per worker (MP_STATUS_CHECK_INTERVAL) before it
    terminates them: a job run in-process after a failed one (a test, a notebook, a search) stalls 10 s with 2
    workers. Torch has no public way to stop persistent workers; a loader without `_iterator` is left as it is.
    Canary: test_an_error_leaves_persistent_loader_workers_running.
    """

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

        held = (trainer.train_dataloader, trainer.val_dataloaders, trainer.test_dataloaders)
        for loader in (item for loaders in held for item in _as_list(loaders)):
            if isinstance(getattr(loader, "_iterator", None), _MultiProcessingDataLoaderIter):
                loader._iterator._shutdown_workers()
                loader._iterator = None


def _as_list(loaders: Any) -> list[Any]:
    """The loaders of a stage, as Lightning holds them: one, a list or a dict of them, or None."""
    if loaders is None:
        return []
    if isinstance(loaders, dict):
        return list(loaders.values())
    return list(loaders) if isinstance(loaders, list | tuple) else [loaders]


def epoch_end(checkpoint: dict[str, Any]) -> str:
    """How the epoch ended of a checkpoint written at the fit loop's end of an epoch (in `on_train_epoch_end`, where
    last.ckpt is written, or after fit): "ran to its end", "cut short" (by max_steps, or a stop inside it), or ""
    for a checkpoint written elsewhere."""
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
    epochs = fit_loop.get("epoch_progress", {}).get("current", {})
    batches = fit_loop.get("epoch_loop.batch_progress", {})
    if not epochs or not batches or not epochs["ready"] == epochs["started"] == epochs["processed"] > 0:
        return ""
    if batches["is_last_batch"]:
        return "ran to its end"
    return "cut short" if batches["current"]["ready"] > 0 else ""


class EpochEndResume(Callback):
    """Resumes from a checkpoint written at an epoch's end (last.ckpt is) where that epoch stopped.

    Lightning 2.6.6. Reasons:
    - An epoch that ran to its end, with `max_steps`: `_FitLoop`'s `restarting` setter takes every restored run with
      max_steps for one to continue inside its last epoch (`or self._iteration_based_training()`). It re-enters the
      finished epoch: at most one batch past its end, then it counts the epoch's end again, so the run trains one
      epoch fewer, and each later epoch in the order of the one after it (measured on digits, 19 steps per epoch,
      from step 19: max_epochs=3 max_steps=40 ended at step 38, max_epochs=2 max_steps=21 at step 19). This makes
      the fit loop read as epoch-based, as it does without max_steps, until it has restored its loops; the private
      method it shadows is checked by gates.EPOCH_END_RESUME.
      Canary: test_max_steps_resume_from_an_epoch_end_reenters_the_finished_epoch.
    - An epoch that max_steps cut short, trained further (a larger max_steps, or none): Lightning counted that epoch
      as processed, so without max_steps it starts the next epoch and never trains the rest, and with max_steps it
      trains the rest in the next epoch's order and counts the epoch twice (measured on digits, cut at step 21 of
      19 per epoch, max_epochs=3: no max_steps ended at step 40, max_steps=45 at step 38). This marks the epoch as
      started but not processed, as in a checkpoint inside an epoch, before Lightning restores its loops.
      Canary: test_resume_from_an_epoch_that_max_steps_cut_short_drops_its_rest.
    """

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn != "fit":
            return
        ended = epoch_end(checkpoint)
        if ended == "ran to its end" and trainer.max_steps != -1:
            trainer.fit_loop._iteration_based_training = lambda: False  # shadows the method, on this loop only
        elif ended == "cut short":
            epochs = checkpoint["loops"]["fit_loop"]["epoch_progress"]
            for counts in (epochs["current"], epochs["total"]):
                counts["processed"] = counts["completed"] = counts["started"] - 1

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        vars(trainer.fit_loop).pop("_iteration_based_training", None)  # the loops are restored


def rescale_batch_progress(checkpoint: dict[str, Any], accumulation: int) -> None:
    """Restate the fit loop's batch counters in micro-batches of `accumulation` per optimizer step.

    Lightning counts an epoch's progress in loader batches (micro-batches): with accumulation a, s optimizer steps
    are s x a batches, and the next optimizer step comes when the count is a multiple of a. The checkpoint says
    which accumulation wrote it (its stored plan). Every counter moves by the same amount, so their relations
    (which tell Lightning where in the batch the checkpoint was taken) hold. A checkpoint taken between the
    micro-batches of a step (SIGTERM with accumulation) goes back to that step's start: it does not hold the
    partial gradients, and the sampler, which counts whole optimizer steps, replays the step from its first sample.
    """
    previous = checkpoint.get("scaleup", {}).get("plan", {}).get("accumulate_grad_batches")
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
    if not previous or not progress:
        return
    shift = progress["current"]["ready"] // previous * accumulation - progress["current"]["ready"]
    for counts in (progress["current"], progress["total"]):
        for key in ("ready", "started", "processed", "completed"):
            counts[key] += shift


class BatchProgressRescale(Callback):
    """Lets a run resume mid-epoch with another accumulation, which another device count with a per-device cap
    brings: rewrites the checkpoint's micro-batch counters (`rescale_batch_progress`) before Lightning restores
    its loops from them.

    Lightning 2.6.6. Reason: Lightning restores the epoch's batch counters as micro-batches of the accumulation that
    wrote the checkpoint, whatever accumulation the resumed run has.
    Canary: test_resume_with_another_accumulation_keeps_the_micro_batch_count.

    The accumulation is final only at `on_fit_start` (`data.max_per_device_batch_size=auto` settles it there),
    after Lightning has handed over the checkpoint and before it restores the loops; strategies that restore
    after setup (FSDP) hand it over later, when the accumulation is already final.
    """

    def __init__(self) -> None:
        self._checkpoint: dict[str, Any] | None = None
        self._fit_started = False

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self._checkpoint = checkpoint  # the dict Lightning restores its loops from
        if self._fit_started:
            self._rescale(trainer)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._fit_started = True
        self._rescale(trainer)

    def _rescale(self, trainer: Any) -> None:
        if self._checkpoint is not None and trainer.state.fn == "fit":
            rescale_batch_progress(self._checkpoint, trainer.accumulate_grad_batches)
        self._checkpoint = None


# --- Sharded training ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def configure_model_counts_as_overridden(module: L.LightningModule) -> Iterator[None]:
    """Lets ModelParallelStrategy.setup accept a module that the template sharded, not its `configure_model`.

    Lightning 2.6.6. Reason: `ModelParallelStrategy.setup` raises TypeError unless the LightningModule overrides
    `configure_model` (where Lightning expects users to apply the parallelism); the template applies fully_shard
    itself, so users keep ordinary modules. While Lightning checks, the module carries an instance attribute (a
    no-op with its own code object), removed afterwards.
    Canary: test_model_parallel_strategy_refuses_a_module_without_configure_model.
    """
    overridden = "configure_model" in vars(module)
    if not overridden:
        module.configure_model = lambda: None  # a different __code__ than LightningModule.configure_model
    try:
        yield
    finally:
        if not overridden:
            del module.configure_model


def model_parallel_precision(precision: str) -> tuple[str | None, list[Any]]:
    """(Trainer's `precision`, precision plugins) for ModelParallelStrategy: float64 as a plugin.

    Lightning 2.6.6. Reason: the accelerator connector refuses `precision="64-true"` with ModelParallelStrategy (it
    allows 32-true, bf16-mixed, bf16-true, 16-true), though FSDP2 trains float64 DTensors on CPU; the same
    DoublePrecision plugin passed in `plugins` is accepted (the check reads only the precision flag).
    Canary: test_model_parallel_strategy_refuses_64_true_as_a_flag.
    """
    from lightning.pytorch.plugins.precision import DoublePrecision

    return (None, [DoublePrecision()]) if precision == "64-true" else (precision, [])


@contextlib.contextmanager
def optimizer_states_keyed_in_group_order(module: torch.nn.Module, optimizers: list[Optimizer]) -> Iterator[None]:
    """While ModelParallelStrategy loads a one-file checkpoint, number its optimizer states as torch does.

    Lightning 2.6.6. Reason: a one-process checkpoint keys the optimizer state by index, over the param groups in
    order; Lightning's `_rekey_optimizer_state_if_needed` maps index i to the module's i-th parameter instead, so
    with two param groups (weights, then biases and norms) every state lands on another parameter (a shape error).
    Here each optimizer's own param groups give the names.
    Canary: test_model_parallel_rekeys_optimizer_state_by_module_order.
    """
    import lightning.fabric.strategies.model_parallel as fabric_model_parallel

    names = {id(param): name for name, param in module.named_parameters()}
    remaining = iter(optimizers)

    def rekey(state: dict[str, Any], _module: Any) -> dict[str, Any]:
        order = [names[id(param)] for group in next(remaining).param_groups for param in group["params"]]
        if not state["state"] or isinstance(next(iter(state["state"])), str):
            return state
        groups = [{**group, "params": [order[i] for i in group["params"]]} for group in state["param_groups"]]
        return {"state": {order[i]: value for i, value in state["state"].items()}, "param_groups": groups}

    original = fabric_model_parallel._rekey_optimizer_state_if_needed
    fabric_model_parallel._rekey_optimizer_state_if_needed = rekey
    try:
        yield
    finally:
        fabric_model_parallel._rekey_optimizer_state_if_needed = original


def read_distributed_checkpoint(path: Any) -> dict[str, Any]:
    """Every entry of a torch.distributed.checkpoint directory, as full tensors on the CPU, without a process group.

    torch 2.14.1. Reason: torch rebuilds a state dict from the stored metadata alone only with the private
    `_EmptyStateDictLoadPlanner` and `_load_state_dict` (what its public `format_utils.dcp_to_torch_save` does,
    which writes the result to a file; the public `dcp.load` fills only the keys it is given).
    Canary: test_private_empty_planner_reads_a_distributed_checkpoint_without_a_process_group.
    """
    from torch.distributed.checkpoint import FileSystemReader

    try:
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    except ImportError:  # the public converter, through a file
        return read_through_torch_save(path)

    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


def read_through_torch_save(path: Any) -> dict[str, Any]:
    """`read_distributed_checkpoint` with torch's public `dcp_to_torch_save`, which writes one file to read back."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(path, f"{scratch}/state.pt")
        return torch.load(f"{scratch}/state.pt", map_location="cpu", weights_only=False)


def stored_tensor_shapes(path: Any, prefix: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """(shape, dtype) of every tensor under `prefix.` in a torch.distributed.checkpoint directory, read from its
    metadata alone (public API: `FileSystemReader.read_metadata`; here for its key format, `<prefix>.<name>`).

    torch 2.14.1. Reason: the flattened key format of the metadata is not documented.
    Canary: test_private_empty_planner_reads_a_distributed_checkpoint_without_a_process_group.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    start = f"{prefix}."
    return {
        key[len(start) :]: (entry.size, entry.properties.dtype)
        for key, entry in metadata.items()
        if key.startswith(start) and isinstance(entry, TensorStorageMetadata)
    }


def stored_file_sizes(path: Any) -> dict[str, int]:
    """The files a torch.distributed.checkpoint directory's metadata refers to, each with its size: the end of the
    last entry stored in it.

    torch 2.14.1. Reason: where each entry lies (`Metadata.storage_data`, `_StorageInfo(relative_path, offset,
    length)`) is FileSystemWriter's own format, not a documented one; where a torch stores it otherwise, no file is
    listed (nothing checked before the load, which still fails on a missing file).
    Canary: test_private_empty_planner_reads_a_distributed_checkpoint_without_a_process_group.
    """
    from torch.distributed.checkpoint import FileSystemReader

    sizes: dict[str, int] = {}
    for stored in FileSystemReader(path).read_metadata().storage_data.values():
        if not all(hasattr(stored, name) for name in ("relative_path", "offset", "length")):
            return {}
        sizes[stored.relative_path] = max(sizes.get(stored.relative_path, 0), stored.offset + stored.length)
    return sizes


# --- Exact evaluation metrics on N processes -------------------------------------------------------------------------

# Lightning's reductions (it refuses any other `reduce_fx`) and the collective that combines each across ranks.
REDUCTIONS = {
    torch.mean: "mean",
    torch.sum: "sum",
    sum: "sum",
    torch.max: "max",
    max: "max",
    torch.min: "min",
    min: "min",
}
GROUP_OF = {"mean": "sum", "sum": "sum", "max": "max", "min": "min"}
REDUCE_GROUPS = (
    ("sum", torch.distributed.ReduceOp.SUM, 0.0),
    ("max", torch.distributed.ReduceOp.MAX, float("-inf")),
    ("min", torch.distributed.ReduceOp.MIN, float("inf")),
)
EPOCH_END_HOOKS = ("on_validation_epoch_end", "on_test_epoch_end")


def _plain_epoch_metrics(trainer: L.Trainer) -> Iterator[tuple[str, Any]]:
    """(key, metric) for this epoch's plain-tensor, epoch-level `self.log` values that Lightning keeps per rank."""
    for key, metric in (trainer._results or {}).items():
        meta = metric.meta
        # rank_zero_only=True: logged by rank 0 alone, on purpose.
        if (
            metric.is_tensor
            and meta.on_epoch
            and not metric.has_reset
            and not (meta.sync.should or meta.sync.rank_zero_only)
        ):
            yield key, metric


def _reducible(metric: Any) -> bool:
    """Logged before the epoch's end (a step or batch hook), from the only eval dataloader."""
    return metric.meta.dataloader_idx is None and metric.meta.fx not in EPOCH_END_HOOKS


class ExactEvalMetrics(Callback):
    """Makes validation and test metrics logged with a plain `self.log(name, tensor)` exact on N processes.

    Lightning 2.6.6. Reason: without `sync_dist=True` Lightning keeps each rank's own epoch value and reports rank
    0's (tests/user_modules.py LitAutoEncoder's test_loss on digits: 0.6789 on 2 processes, 0.6824 on 1; each rank's
    ModelCheckpoint even names a different best file), and with `sync_dist=True` it averages per-rank means,
    mis-weighting ranks with fewer samples (Lightning #21859). This reads the private ResultCollection
    (`trainer._results`, `_ResultMetric.value`, `.cumulated_batch_size`, `.meta`).
    Canary: test_plain_self_log_keeps_each_rank_its_own_epoch_value.

    At the end of each validation/test epoch, before Lightning computes the epoch values, every rank's accumulated
    state is summed once across ranks: for a mean, the sum of value x batch size and the sum of batch sizes (so the
    epoch value is weighted by batch size over all samples, as on one process); sums are summed, maxima and minima
    reduced with max and min. Metrics logged as torchmetrics objects or with `sync_dist=True` are left alone
    (Lightning reduces them). Training-stage metrics are out of scope: each rank keeps its own. What cannot be made
    exact is named once, loudly, at the end of the first validation or test: values logged in the module's own
    `on_validation_epoch_end`/`on_test_epoch_end` (they are logged after this runs) and metrics of a second eval
    dataloader. Lightning refuses any other `reduce_fx` itself.

    Every rank runs the same collectives in the same order: one all_gather of the metric names (a name logged on
    some ranks only counts zero samples, or no maximum, on the others), then one all_reduce per kind of reduction,
    in sorted name order. Needs every rank to reach the end of the eval epoch (each rank with at least one batch:
    Lightning skips an empty eval loop, and its collectives, on that rank alone).
    """

    def __init__(self) -> None:
        self._warned = False
        self._quiet: set[str] = set()

    def on_validation_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self._silence_sync_dist_advice(trainer)

    def on_test_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self._silence_sync_dist_advice(trainer)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._reduce(trainer)

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._reduce(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._warn_once(trainer)

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._warn_once(trainer)

    def _reduce(self, trainer: L.Trainer) -> None:
        if trainer.world_size == 1 or not torch.distributed.is_initialized():
            return
        local = {key: metric for key, metric in _plain_epoch_metrics(trainer) if _reducible(metric)}
        gathered: list[Any] = [None] * trainer.world_size
        torch.distributed.all_gather_object(gathered, [(key, REDUCTIONS[m.meta.reduce_fx]) for key, m in local.items()])
        keys = sorted(set().union(*gathered))  # (key, reduction): the same list, in the same order, on every rank
        device = trainer.strategy.root_device
        for group, op, identity in REDUCE_GROUPS:
            entries = [(key, kind) for key, kind in keys if GROUP_OF[kind] == group]
            if not entries:
                continue
            # One flat float64 tensor per kind of reduction: values, then the sample counts of the means. float64
            # carries float32 values and integer counts exactly; a rank without the metric adds the identity.
            means = [key for key, kind in entries if kind == "mean"]
            state = torch.tensor([identity] * len(entries) + [0.0] * len(means), dtype=torch.float64, device=device)
            for index, (key, _) in enumerate(entries):
                if key in local:
                    state[index] = local[key].value.double()
            for index, key in enumerate(means):
                if key in local:
                    state[len(entries) + index] = local[key].cumulated_batch_size.double()
            torch.distributed.all_reduce(state, op=op)
            for index, (key, _) in enumerate(entries):
                if key in local:
                    local[key].value = state[index].to(local[key].value)
            for index, key in enumerate(means):
                if key in local:
                    counts = local[key].cumulated_batch_size
                    local[key].cumulated_batch_size = state[len(entries) + index].to(counts)
        for metric in local.values():
            metric._computed = None  # Lightning computed a per-rank value after the last batch: recompute it

    def _silence_sync_dist_advice(self, trainer: L.Trainer) -> None:
        """Lightning advises `sync_dist=True` for these metrics when it first computes them, after the last batch:
        it no longer applies (and would mis-weight uneven ranks)."""
        if trainer.world_size == 1:
            return
        for _, metric in _plain_epoch_metrics(trainer):
            name = metric.meta.name
            if name not in self._quiet and _reducible(metric):
                self._quiet.add(name)
                warnings.filterwarnings("ignore", message=rf"It is recommended to use `self.log\({name!r}")

    def _warn_once(self, trainer: L.Trainer) -> None:
        if self._warned or trainer.world_size == 1:
            return
        self._warned = True
        inexact = sorted({metric.meta.name for _, metric in _plain_epoch_metrics(trainer) if not _reducible(metric)})
        if inexact and trainer.is_global_zero:
            log.warning(
                f"NOT EXACT on {trainer.world_size} processes: {', '.join(inexact)} (logged with a plain tensor in "
                "on_validation_epoch_end/on_test_epoch_end, or from a second eval dataloader) is each rank's own "
                "value, and rank 0's is reported. Log a torchmetrics Metric instead (or scaleup.observability.metrics."
                "StageMetrics), which sums its state over all ranks once per epoch"
            )
