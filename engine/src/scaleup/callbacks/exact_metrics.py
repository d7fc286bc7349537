"""Validation and test metrics of a plain `self.log(name, tensor)` made exact on N processes: every rank's
samples counted, as on one process.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities import move_data_to_device
from torchmetrics import Metric

from scaleup.errors import UserError
from scaleup.observability.metrics import StageMetrics
from scaleup.observability.quiet import SYNC_DIST_ADVICE, QuietBetweenHooks

log = logging.getLogger("scaleup")


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
# The checkpoint's entry for the training epoch's running metric states: {"epoch": n, "ranks": [per-rank states]}.
TRAINING_EPOCH = "training_epoch_metrics"


def _epoch_tensor_metrics(trainer: L.Trainer, *, synced: bool = False) -> Iterator[tuple[str, Any]]:
    """(key, metric) for this epoch's tensor-valued, epoch-level `self.log` values: those Lightning keeps per rank
    (`synced=False`), or those logged with `sync_dist=True` (`synced=True`)."""
    for key, metric in (trainer._results or {}).items():
        meta = metric.meta
        # rank_zero_only=True: logged by rank 0 alone, on purpose.
        if (
            metric.is_tensor
            and meta.on_epoch
            and not metric.has_reset
            and not meta.sync.rank_zero_only
            and meta.sync.should == synced
        ):
            yield key, metric


def _training_stage_metrics(pl_module: L.LightningModule) -> list[tuple[str, StageMetrics]]:
    """(name, module) of each StageMetrics in the module that has a training stage."""
    return [(name, m) for name, m in pl_module.named_modules() if isinstance(m, StageMetrics) and "train" in m.stages]


def _training_states(pl_module: L.LightningModule) -> dict[str, dict[str, Any]]:
    """A copy of the training states of each StageMetrics in the module, by its name."""
    return {name: metrics.epoch_states("train") for name, metrics in _training_stage_metrics(pl_module)}


def _reducible(metric: Any) -> bool:
    """Logged before the epoch's end (a step or batch hook), from the only eval dataloader."""
    return metric.meta.dataloader_idx is None and metric.meta.fx not in EPOCH_END_HOOKS


class ExactEvalMetrics(Callback):
    """Makes validation and test metrics logged with a plain `self.log(name, tensor)` exact on N processes.

    Lightning 2.6.6. Reason: without `sync_dist=True` Lightning keeps each rank's own epoch value and reports rank
    0's (tests/user_modules.py LitAutoEncoder's test_loss on digits: 0.6789 on 2 processes, 0.6824 on 1; each rank's
    ModelCheckpoint even names a different best file), and with `sync_dist=True` it averages each rank's sum and
    each rank's sample count over the ranks, the count (an integer tensor) divided by the world size in integers:
    181 samples on 2 ranks count as 90, not 90.5, and the mean comes out 0.55% high (a user's val loss: 1.4047 on
    2 processes, 1.3902 on 1). This reads the private ResultCollection (`trainer._results`, `_ResultMetric.value`,
    `.cumulated_batch_size`, `.meta`). Canaries: test_plain_self_log_keeps_each_rank_its_own_epoch_value,
    test_sync_dist_truncates_the_sample_count_of_a_mean.

    At the end of each validation/test epoch, before Lightning computes the epoch values, every rank's accumulated
    state is summed once across ranks: for a mean, the sum of value x batch size and the sum of batch sizes (so the
    epoch value is weighted by batch size over all samples, as on one process); sums are summed, maxima and minima
    reduced with max and min. A mean logged with `sync_dist=True` keeps Lightning's reduction, its sample count made
    a float after each batch, so that Lightning's division by the world size is exact; sums, maxima and minima with
    `sync_dist=True` are exact as Lightning reduces them, and so are torchmetrics objects. Training-stage metrics
    are out of scope: each rank keeps its own. What cannot be made exact is named once, loudly, at the end of the
    first validation or test: values logged in the module's own `on_validation_epoch_end`/`on_test_epoch_end` (they
    are logged after this runs) that differ between ranks, without `sync_dist` (rank 0's is reported) or with it as a
    mean (the ranks' values averaged, however many samples each rank had), and plain metrics of a second eval
    dataloader. Lightning refuses any other `reduce_fx` itself.

    Every rank runs the same collectives in the same order: one all_gather of the metric names (a name logged on
    some ranks only counts zero samples, or no maximum, on the others), then one all_reduce per kind of reduction,
    in sorted name order. Needs every rank to reach the end of the eval epoch (each rank with at least one batch:
    Lightning skips an empty eval loop, and its collectives, on that rank alone).

    Also, as the eval metrics' keeper: each process gets torchmetrics states of its own when a stage is set up
    (ddp_spawn hands the module to its processes through shared memory, so on CPU every rank's states would be one
    shared tensor, each rank adding into the others' sums); and with `monitor` (training), a `monitor.metric` the
    module does not log is refused at the end of the first validation, naming the metrics it does log (instead of
    ModelCheckpoint's traceback); and the training epoch's running states of the module's `StageMetrics`
    (`train/loss`, `train/samples`, `train/acc`: sums that torchmetrics keeps out of the state_dict) travel in every
    checkpoint written inside an epoch, every rank's, as of the last optimizer step (a checkpoint between the
    micro-batches of a step resumes at its start), and a resume inside the same epoch continues them, each rank
    from its own (from its share of them on fewer ranks, merged; more ranks start the rest empty), so that the
    epoch's values cover every sample as in an uninterrupted run. A module's own torchmetrics objects outside
    StageMetrics are its own to save.
    """

    def __init__(self, monitor: str | None = None) -> None:
        self.monitor = monitor
        self._warned = False
        self._quiet: set[str] = set()
        self._advice = QuietBetweenHooks(SYNC_DIST_ADVICE)
        self._resumed_epoch: dict[str, Any] | None = None
        self._at_last_step: dict[str, Any] | None = None

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._remember_step(trainer, pl_module)  # the epoch's states, empty

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._remember_step(trainer, pl_module)  # every micro-batch of the step updated its metrics in training_step

    def _remember_step(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """With accumulation, the training states as of the last optimizer step, kept on the device: a checkpoint
        written between the micro-batches of a step (SIGTERM) resumes from the step's start and replays them, so it
        carries the states without them."""
        if trainer.accumulate_grad_batches > 1:
            self._at_last_step = _training_states(pl_module)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        """Every rank's training-epoch states (as of the last optimizer step) into a checkpoint written before the
        epoch's last batch (inside it, or at the end of an epoch cut short): after the last one the epoch is whole,
        and a resume starts the next. Every rank saves: the gather is collective."""
        if not _training_stage_metrics(pl_module) or trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            return
        states = self._at_last_step if trainer.accumulate_grad_batches > 1 else None
        local = move_data_to_device(states or _training_states(pl_module), "cpu")
        ranks = [local]
        if trainer.world_size > 1 and torch.distributed.is_initialized():
            ranks = [None] * trainer.world_size
            torch.distributed.all_gather_object(ranks, local)
        checkpoint[TRAINING_EPOCH] = {"epoch": trainer.current_epoch, "ranks": ranks}

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if trainer.state.fn == "fit":
            self._resumed_epoch = checkpoint.get(TRAINING_EPOCH)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After a resume into the checkpoint's epoch (the loops restored), its running states continue from the
        checkpoint's. (Lightning calls no `on_train_epoch_start` for an epoch it resumes inside.)"""
        resumed, self._resumed_epoch = self._resumed_epoch, None
        if resumed is None or resumed["epoch"] != trainer.current_epoch:
            return
        share = resumed["ranks"][trainer.global_rank :: trainer.world_size]
        for name, metrics in _training_stage_metrics(pl_module):
            unmerged = metrics.restore_epoch_states("train", [states.get(name, {}) for states in share])
            if unmerged and trainer.is_global_zero:
                log.warning(
                    f"train/{', train/'.join(unmerged)}: resumed on fewer ranks, this epoch's value covers the "
                    "samples of some ranks only (a metric with full_state_update cannot merge ranks' states)"
                )
        self._remember_step(trainer, pl_module)  # a resume starts at a step's start

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for module in pl_module.modules():
            if isinstance(module, Metric):
                module.reset()

    def on_validation_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self._after_batch(trainer)

    def on_test_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self._after_batch(trainer)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._reduce(trainer)
        self._quiet_advice(trainer)

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._reduce(trainer)
        self._quiet_advice(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._advice.stop()
        self._warn_once(trainer)
        if self.monitor is None or trainer.sanity_checking or self.monitor in trainer.callback_metrics:
            return
        logged = ", ".join(sorted(name for name in trainer.callback_metrics if name.startswith("val/"))) or "nothing"
        raise UserError(
            f"monitor.metric={self.monitor} is not logged by {type(pl_module).__name__}, which logs {logged}: set "
            "monitor.metric (and monitor.mode=min|max) to one of them, e.g. in your experiment config"
        )

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._advice.stop()
        self._warn_once(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._advice.stop()

    def _quiet_advice(self, trainer: L.Trainer) -> None:
        """No advice of Lightning's to log with `sync_dist=True` while it computes the epoch values, after the
        module's own epoch-end hook (which runs after this one): a value logged there is named by `_warn_once`."""
        if trainer.world_size > 1:
            self._advice.start()

    def _reduce(self, trainer: L.Trainer) -> None:
        if trainer.world_size == 1 or not torch.distributed.is_initialized():
            return
        local = {key: metric for key, metric in _epoch_tensor_metrics(trainer) if _reducible(metric)}
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

    def _after_batch(self, trainer: L.Trainer) -> None:
        if trainer.world_size > 1:
            self._count_synced_means_in_floats(trainer)
            self._silence_sync_dist_advice(trainer)

    @staticmethod
    def _count_synced_means_in_floats(trainer: L.Trainer) -> None:
        """A `sync_dist=True` mean's sample count as a float of the value's dtype, before Lightning reduces it.

        Lightning reduces such a mean when it first computes it, after the last batch: the rank average of the sums
        over the rank average of the sample counts, the count averaged in place, and an integer count drops the
        half of an odd total (181 samples on 2 ranks count as 90). A float count keeps it, so the mean is the sum
        over all samples over their number, as on one process. A count already a float stays one as batches add to
        it; Lightning makes it an integer again at each epoch's start."""
        for _, metric in _epoch_tensor_metrics(trainer, synced=True):
            if REDUCTIONS[metric.meta.reduce_fx] == "mean" and not metric.cumulated_batch_size.is_floating_point():
                metric.cumulated_batch_size = metric.cumulated_batch_size.to(metric.value.dtype)

    def _silence_sync_dist_advice(self, trainer: L.Trainer) -> None:
        """Lightning advises `sync_dist=True` for these metrics when it first computes them, after the last batch:
        it no longer applies (and would mis-weight uneven ranks), or, for a second eval dataloader's, `_warn_once`
        names the metric with what to do instead."""
        for _, metric in _epoch_tensor_metrics(trainer):
            name = metric.meta.name
            if name not in self._quiet:
                self._quiet.add(name)
                warnings.filterwarnings("ignore", message=rf"It is recommended to use `self.log\({name!r}")

    def _warn_once(self, trainer: L.Trainer) -> None:
        if self._warned or trainer.world_size == 1 or not torch.distributed.is_initialized():
            return
        self._warned = True
        inexact = _inexact_metrics(trainer)
        if inexact and trainer.is_global_zero:
            log.warning(
                f"NOT EXACT on {trainer.world_size} processes: {', '.join(inexact)}: logged with a plain tensor in "
                "on_validation_epoch_end/on_test_epoch_end, where the ranks hold different values, or from a second "
                "eval dataloader. Log a torchmetrics Metric instead (or scaleup.api.StageMetrics), "
                "which sums its state over all ranks once per epoch"
            )


def _rank_value(metric: Any) -> float:
    """This rank's own value of an epoch-level tensor metric (a mean's sum over its sample count)."""
    value = metric.value.double()
    if REDUCTIONS[metric.meta.reduce_fx] == "mean":
        value = value / metric.cumulated_batch_size.double()
    return float(value)


def _inexact_metrics(trainer: L.Trainer) -> list[str]:
    """The names of this epoch's values no reduction made exact, each with what is reported: a plain value of a
    second eval dataloader, and a value logged at the eval epoch's end (after the reduction) whose ranks differ,
    without `sync_dist` (rank 0's reported) or with it as a mean (the ranks' values averaged, unweighted). A value
    the same on every rank (a torchmetrics `compute()`, already over all ranks) is exact either way; so are the
    sums, maxima and minima `sync_dist=True` makes of the ranks' values. Collective: runs on every rank."""
    late = {
        metric.meta.name: (_rank_value(metric), metric.meta.sync.should)
        for _, metric in [*_epoch_tensor_metrics(trainer), *_epoch_tensor_metrics(trainer, synced=True)]
        if metric.meta.fx in EPOCH_END_HOOKS
        and (not metric.meta.sync.should or REDUCTIONS[metric.meta.reduce_fx] == "mean")
    }
    gathered: list[Any] = [None] * trainer.world_size
    # A name logged on some ranks only differs too.
    torch.distributed.all_gather_object(gathered, {name: value for name, (value, _) in late.items()})
    named = {
        name: "the ranks' values averaged" if synced else "rank 0's value reported"
        for name, (_, synced) in late.items()
        if any(ranks.get(name) != gathered[0].get(name) for ranks in gathered)
    }
    for _, metric in _epoch_tensor_metrics(trainer):
        if metric.meta.dataloader_idx is not None and metric.meta.fx not in EPOCH_END_HOOKS:
            named[metric.meta.name] = "rank 0's value reported"
    return [f"{name} ({named[name]})" for name in sorted(named)]
