"""Lightning's loop state across a resume (counters it writes inconsistently, epochs it re-enters or drops), the
loader workers it leaves running after an error, and the warning it gives for a loader the template does resume.
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


class LoopRepairs(Callback):
    """Repairs Lightning's loop state across a resume and stops the loader workers it leaves running after an error.

    Lightning 2.6.6 (torch 2.14.1). Each repair below names the measured failure, and its canary in
    engine/tests/test_lightning_workarounds.py shows that plain Lightning still has it. On a resume Lightning hands
    over the checkpoint (`on_load_checkpoint`) before it restores its loops from it; the repairs rewrite that dict
    in this order:

    - The epoch counter of a checkpoint written inside an epoch that a resume from an epoch's last batch started:
      Lightning starts that epoch without counting it as started in `epoch_progress`, so the checkpoint looks like
      the epoch before it and the next resume trains the whole epoch again (measured: 32 steps instead of 24 after
      two such resumes). A checkpoint written inside `on_train_batch_end` always belongs to a started epoch: it is
      marked so. Canary: test_resume_after_an_epoch_end_checkpoint_leaves_the_epoch_unstarted. The checkpoint at
      such an epoch's end counts it as processed only (ready and started one behind), and a resume from it trains
      another number of steps than planned: it is marked started too.
      Canary: test_an_epoch_resumed_from_its_predecessors_last_batch_ends_counted_as_processed_only.
    - A checkpoint written at an epoch's end (last.ckpt is) resumes where that epoch stopped:
      - an epoch that ran to its end, with `max_steps`: Lightning's fit loop re-enters the finished epoch, a bug
        in its live loop that no checkpoint counter repairs: `install_fit_loop_fixes` gives the Trainer the fit loop
        of compat/lightning_2_6.py, whose `restarting` setter is fixed as the upstream patch would be.
        Canary: test_max_steps_resume_from_an_epoch_end_reenters_the_finished_epoch.
      - an epoch that max_steps cut short, trained further: Lightning counted it as processed, so it never trains
        the rest (measured: cut at step 21 of 19 per epoch, max_epochs=3: no max_steps ended at step 40). The epoch
        is marked as started but not processed, as in a checkpoint inside an epoch.
        Canary: test_resume_from_an_epoch_that_max_steps_cut_short_drops_its_rest.
    - Another accumulation (another device count with a per-device cap): Lightning restores the epoch's batch
      counters as micro-batches of the accumulation that wrote the checkpoint; they are restated in this run's
      (`rescale_batch_progress`). The accumulation is final only at `on_fit_start` (`data.max_per_device_batch_size=
      auto` settles it there, in the callback before this one); strategies that restore after setup (FSDP) hand the
      checkpoint over later, when it is final.
      Canary: test_resume_with_another_accumulation_keeps_the_micro_batch_count.

    After an error, Lightning tears down the failing loop only: an error in validation inside fit leaves the training
    loader's persistent workers running, and the garbage collector later makes torch wait 5 s per worker: a job run
    in-process after a failed one (a test, a notebook, a search) stalls. The fit loop is torn down here too, as
    Lightning tears it down after a fit that ends well: its loaders' workers stop (`CombinedLoader.reset`).
    Canary: test_an_error_leaves_persistent_loader_workers_running.
    """

    def __init__(self) -> None:
        self._checkpoint: dict[str, Any] | None = None
        self._fit_started = False

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        repair_epoch_progress(checkpoint)
        if trainer.state.fn == "fit":
            ended = epoch_end(checkpoint)
            if ended == "cut short":
                epochs = checkpoint["loops"]["fit_loop"]["epoch_progress"]
                for counts in (epochs["current"], epochs["total"]):
                    counts["processed"] = counts["completed"] = counts["started"] - 1
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

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        trainer.fit_loop.teardown()  # once more where Lightning tore it down (an error in training): a no-op


def install_fit_loop_fixes(trainer: L.Trainer) -> None:
    """Give a Trainer with `max_steps` the fit loop of compat/lightning_2_6.py, on the Lightning releases whose own
    fit loop re-enters a finished epoch on a resume (see LoopRepairs); call it after `gates.EPOCH_END_RESUME` has
    checked the private class that loop derives from."""
    if trainer.max_steps == -1:
        return
    from scaleup.compat import lightning_2_6  # Lightning's private loop classes: imported only where needed

    if lightning_2_6.AFFECTED.contains(L.__version__):
        lightning_2_6.install_fit_loop(trainer)


def repair_epoch_progress(checkpoint: dict[str, Any]) -> None:
    """Mark the epoch of a checkpoint as started where Lightning did not count it (see LoopRepairs): one written
    inside `on_train_batch_end`, and one written at the end of such an epoch, which Lightning counted as processed
    only (its ready and started one behind: the next resume would take the epoch for the one before it)."""
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
    batches = fit_loop.get("epoch_loop.batch_progress", {}).get("current", {})
    epochs = fit_loop.get("epoch_progress")
    if not epochs:
        return
    current = epochs["current"]
    saved_inside_batch_end = batches.get("completed", 0) < batches.get("ready", 0)
    uncounted_at_its_end = current["ready"] == current["started"] == current["completed"] == current["processed"] - 1
    if saved_inside_batch_end and current["ready"] == current["completed"]:
        for counts in (epochs["current"], epochs["total"]):
            counts["ready"] = counts["started"] = counts["completed"] + 1
    elif uncounted_at_its_end:
        for counts in (epochs["current"], epochs["total"]):
            counts["ready"] = counts["started"] = counts["processed"]


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
