"""Lightning's loop state across a resume: counters it writes inconsistently, epochs it re-enters or drops, loader
workers it leaves running, and the warning it gives for a loader the template does resume.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
from lightning.pytorch import Callback

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
