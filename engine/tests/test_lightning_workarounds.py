"""Canaries of engine/src/scaleup/compat/ and of the features that read Lightning's private state: one per
workaround, each on plain Lightning WITHOUT it, and each workaround against Lightning's own code.

Each canary asserts the Lightning 2.6.6 behaviour (or private API) that made its workaround necessary. When one fails
after an upgrade, Lightning changed that behaviour: delete the workaround its docstring names, and this canary.
Private names are imported inside the tests that need them: a name a release removed fails its own canary only.
"""

import contextlib
import copy
import inspect
import multiprocessing
import os
import queue
import signal
import warnings

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.environments import LightningEnvironment
from lightning.pytorch.plugins.precision import DoublePrecision
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import SumMetric

from scaleup.compat import fast_paths
from scaleup.compat.dcp import read_distributed_checkpoint, stored_file_sizes, stored_tensor_shapes
from scaleup.compat.fast_paths import LeanModelCheckpoint
from scaleup.compat.fast_paths import fast_paths as fast_paths_on
from scaleup.compat.loggers import is_logging_step
from scaleup.compat.loops import UNRESUMABLE_LOADER_WARNING, EpochEndResume, LoaderWorkersStop
from scaleup.compat.model_parallel import optimizer_states_keyed_in_group_order
from scaleup.compat.precision import model_parallel_precision
from scaleup.observability.metrics import SampleSum, TopKAccuracy

BATCHES_PER_EPOCH = 4


class Tiny(L.LightningModule):
    """A linear layer on 8 fixed samples, 4 batches of 2 per epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).pow(2).mean()

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self.layer(batch[0]).pow(2).mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.linspace(-1, 1, 32).view(8, 4)), batch_size=2)

    test_dataloader = train_dataloader


def trainer(tmp_path, **kwargs) -> L.Trainer:
    options = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in kwargs.get("callbacks", [])),
        default_root_dir=tmp_path,
    )
    return L.Trainer(**{**options, **kwargs})


def save_every(steps: int, dirpath) -> ModelCheckpoint:
    """Checkpoints `step=N.ckpt` every `steps` optimizer steps, written in on_train_batch_end."""
    return ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=steps, save_top_k=-1)


def loops(path) -> dict:
    return torch.load(path, weights_only=True)["loops"]["fit_loop"]


def test_mid_epoch_resume_warns_for_a_loader_without_state_dict(tmp_path):
    """ignore_unresumable_loader_warning: Lightning warns on every mid-epoch resume of a loader without state_dict."""
    trainer(tmp_path, max_steps=2, callbacks=[save_every(2, tmp_path)]).fit(Tiny())
    with pytest.warns(UserWarning, match=UNRESUMABLE_LOADER_WARNING):
        trainer(tmp_path, max_epochs=1).fit(Tiny(), ckpt_path=tmp_path / "step=2.ckpt")


def test_spawn_worker_leaves_the_process_group_up(tmp_path, monkeypatch):
    """CleanExitLauncher: Lightning's spawn worker function returns with the process group still initialized."""
    monkeypatch.setenv("LOCAL_RANK", "0")  # the worker function sets it; restored after the test
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # keeps the worker function from changing torch's thread count
    strategy = DDPStrategy(
        start_method="spawn", parallel_devices=[torch.device("cpu")], cluster_environment=LightningEnvironment()
    )
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    strategy._configure_launcher()
    assert type(strategy.launcher) is _MultiProcessingLauncher
    assert "return_queue" in inspect.signature(_MultiProcessingLauncher._wrapping_function).parameters

    def worker() -> None:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)

    try:
        strategy.launcher._wrapping_function(0, None, worker, (), {}, queue.Queue())
        assert dist.is_initialized()  # nothing after the worker's function took it down
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_log_hyperparams_with_metrics_adds_a_scalar_point(tmp_path):
    """add_summaries: log_hyperparams(params, metrics) also writes every metric as a scalar point."""
    logger = TensorBoardLogger(tmp_path, name="", version="")
    logger.log_hyperparams({"lr": 0.1}, metrics={"test_loss": 0.5}, step=7)
    logger.finalize("success")
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("test_loss")] == [(7, 0.5)]
    assert callable(logger.experiment._get_file_writer)  # the private torch method add_summaries writes through


def test_ema_average_is_built_before_the_model_moves_to_its_device(tmp_path):
    """EMA (device): EMAWeightAveraging builds its average in setup, before the strategy moves the model, on
    `pl_module.device` unless the private `_device` is set."""
    order = []

    class Moving(SingleDeviceStrategy):
        def model_to_device(self) -> None:
            order.append("model_to_device")
            super().model_to_device()

    class Recording(EMAWeightAveraging):
        def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
            assert self._device is None
            super().setup(trainer, pl_module, stage)
            order.append("average built")

    strategy = Moving(device=torch.device("cpu"))
    trainer(tmp_path, max_steps=1, strategy=strategy, callbacks=[Recording()]).fit(Tiny())
    assert order == ["average built", "model_to_device"]


def test_ema_testing_a_checkpoint_after_fit_loads_the_training_weights(tmp_path):
    """EMA (test after fit): after fit, testing a checkpoint loads its training weights, not its average."""
    model = Tiny()
    run = trainer(tmp_path, max_steps=BATCHES_PER_EPOCH, callbacks=[EMAWeightAveraging(), save_every(2, tmp_path)])
    run.fit(model)
    saved = torch.load(tmp_path / "step=2.ckpt", weights_only=True)  # the average in state_dict
    assert not torch.equal(saved["state_dict"]["layer.weight"], saved["current_model_state"]["layer.weight"])
    run.test(model, ckpt_path=tmp_path / "step=2.ckpt", verbose=False)
    assert torch.equal(model.layer.weight, saved["current_model_state"]["layer.weight"])


def test_resume_after_an_epoch_end_checkpoint_leaves_the_epoch_unstarted(tmp_path):
    """EpochProgressRepair: resumed from a checkpoint at an epoch's last batch, Lightning does not count the next
    epoch as started, so a checkpoint inside it says the epoch before, and resuming that repeats the epoch."""
    trainer(tmp_path, max_epochs=1, callbacks=[save_every(BATCHES_PER_EPOCH, tmp_path)]).fit(Tiny())
    trainer(tmp_path, max_steps=6, callbacks=[save_every(2, tmp_path)]).fit(Tiny(), ckpt_path=tmp_path / "step=4.ckpt")
    inside = loops(tmp_path / "step=6.ckpt")
    assert inside["epoch_progress"]["current"]["ready"] == inside["epoch_progress"]["current"]["completed"] == 1
    resumed = trainer(tmp_path, max_epochs=3)
    resumed.fit(Tiny(), ckpt_path=tmp_path / "step=6.ckpt")
    assert resumed.global_step > 3 * BATCHES_PER_EPOCH  # epoch 1 trained again


class Batches(L.Callback):
    """Records (epoch, batch_idx) of every training batch."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch, batch_idx: int) -> None:
        self.seen.append((trainer.current_epoch, batch_idx))


def epoch_end_checkpoint(tmp_path, where: str = "in on_train_epoch_end", **first) -> str:
    """A checkpoint at the fit loop's end of epoch 0 (`first`: the Trainer's limits): written in on_train_epoch_end
    (as last.ckpt is), or after fit."""
    end = ModelCheckpoint(dirpath=tmp_path, filename="end", save_on_train_epoch_end=True)
    run = trainer(tmp_path, callbacks=[end], **{"max_epochs": 1, **first})
    run.fit(Tiny())
    if where == "after fit":
        run.save_checkpoint(tmp_path / "end.ckpt")
    return tmp_path / "end.ckpt"


def resumed_batches(tmp_path, ckpt, callbacks=(), **limits) -> tuple[list[tuple[int, int]], int, torch.Tensor]:
    """(epoch, batch_idx) of each batch a resume from `ckpt` trains, its last step and its final weight."""
    batches, model = Batches(), Tiny()
    run = trainer(tmp_path / "resumed", callbacks=[batches, *callbacks], **limits)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unresumable-loader warning
        run.fit(model, ckpt_path=ckpt)
    return batches.seen, run.global_step, model.layer.weight.detach()


def test_max_steps_resume_from_an_epoch_end_reenters_the_finished_epoch(tmp_path):
    """EpochEndResume: with max_steps, Lightning restores a run whose epoch ran to its end as one to continue inside
    that epoch: one batch past its end, then the epoch counts as done a second time."""
    seen, step, _ = resumed_batches(tmp_path, epoch_end_checkpoint(tmp_path), max_epochs=2, max_steps=100)
    assert seen == [(0, BATCHES_PER_EPOCH)] and step == BATCHES_PER_EPOCH + 1


def test_resume_from_an_epoch_that_max_steps_cut_short_drops_its_rest(tmp_path):
    """EpochEndResume: Lightning counts an epoch that max_steps cut short (2 of 4 batches) as processed; trained
    further without max_steps, the resume starts the next epoch and never trains the rest."""
    seen, step, _ = resumed_batches(tmp_path, epoch_end_checkpoint(tmp_path, max_steps=2), max_epochs=2)
    assert seen == [(1, i) for i in range(BATCHES_PER_EPOCH)] and step == 2 + BATCHES_PER_EPOCH


@pytest.mark.parametrize("where", ["in on_train_epoch_end", "after fit"])
def test_epoch_end_resume_with_max_steps_trains_what_a_resume_without_trains(tmp_path, where):
    ckpt = epoch_end_checkpoint(tmp_path, where)
    without = resumed_batches(tmp_path, ckpt, max_epochs=2)  # Lightning's own resume
    with_max_steps = resumed_batches(tmp_path, ckpt, [EpochEndResume()], max_epochs=2, max_steps=100)
    assert without[:2] == with_max_steps[:2] == ([(1, i) for i in range(BATCHES_PER_EPOCH)], 2 * BATCHES_PER_EPOCH)
    assert torch.equal(without[2], with_max_steps[2])


@pytest.mark.parametrize("max_steps", [-1, 100])
def test_epoch_end_resume_trains_the_rest_of_an_epoch_that_max_steps_cut_short(tmp_path, max_steps):
    ckpt = epoch_end_checkpoint(tmp_path, max_steps=2)
    seen, step, _ = resumed_batches(tmp_path, ckpt, [EpochEndResume()], max_epochs=2, max_steps=max_steps)
    assert seen == [(0, 2), (0, 3), *[(1, i) for i in range(BATCHES_PER_EPOCH)]] and step == 2 * BATCHES_PER_EPOCH


def test_resume_with_another_accumulation_keeps_the_micro_batch_count(tmp_path):
    """BatchProgressRescale: a resumed run restores the epoch's batch counter in the checkpoint's micro-batches."""
    trainer(tmp_path, max_steps=2, callbacks=[save_every(2, tmp_path)]).fit(Tiny())  # 2 batches of accumulation 1
    seen = []

    class Count(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch, batch_idx: int) -> None:
            seen.append(batch_idx)

    resumed = trainer(tmp_path, max_epochs=1, accumulate_grad_batches=2, callbacks=[Count()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unresumable-loader warning
        resumed.fit(Tiny(), ckpt_path=tmp_path / "step=2.ckpt")
    # Lightning resumes at batch 2 of 4: "1 step" of the new accumulation, although 2 optimizer steps were taken.
    assert seen == [2, 3] and resumed.global_step == 2 + (BATCHES_PER_EPOCH - 2) // 2


def test_plain_self_log_keeps_each_rank_its_own_epoch_value():
    """ExactEvalMetrics: `self.log(name, tensor)` without sync_dist accumulates value x batch size and batch sizes
    per rank and computes its epoch value with a no-op sync, i.e. from this rank's batches alone."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection, _Sync

    results = _ResultCollection(training=False)
    results.log("validation_step", "val_loss", torch.tensor(1.0), batch_size=2)
    results.log("validation_step", "val_loss", torch.tensor(4.0), batch_size=1)
    metric = results["validation_step.val_loss"]
    assert metric.meta.sync.should is False and metric.meta.sync.fn is _Sync.no_op
    assert metric.meta.reduce_fx is torch.mean and metric.is_tensor and metric.meta.on_epoch
    assert (metric.value.item(), metric.cumulated_batch_size.item()) == (6.0, 3)
    assert metric.compute().item() == 2.0


def synced_means(rank: int, store: str, out) -> None:
    """One of 2 gloo ranks: a `sync_dist=True` mean of 1.0 over 91 samples (rank 0) and 2.0 over 90 (rank 1), as
    Lightning computes it with its DDP reduction, and once more with the sample count made a float first."""
    from lightning.fabric.utilities.distributed import _sync_ddp_if_available
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    results = _ResultCollection(training=False)
    value, samples = (1.0, 91) if rank == 0 else (2.0, 90)
    for name in ("as_logged", "float_count"):
        results.log(
            "validation_step", name, torch.tensor(value), batch_size=samples, sync_dist=True,
            sync_dist_fn=_sync_ddp_if_available,
        )  # fmt: skip
    as_logged, float_count = results["validation_step.as_logged"], results["validation_step.float_count"]
    float_count.cumulated_batch_size = float_count.cumulated_batch_size.to(float_count.value.dtype)
    out.put((rank, as_logged.compute().item(), as_logged.cumulated_batch_size.item(), float_count.compute().item()))
    dist.destroy_process_group()


def test_sync_dist_truncates_the_sample_count_of_a_mean(tmp_path):
    """ExactEvalMetrics: Lightning syncs a `sync_dist=True` mean as the rank average of the sums over the rank average
    of the sample counts, the count averaged in place as an integer, which truncates (181 / 2 = 90): the mean of 91
    samples at 1.0 and 90 at 2.0, 271 / 181, comes out as 135.5 / 90. A count made a float before it is exact."""
    fork = multiprocessing.get_context("fork")  # torch is imported already: the ranks start in a moment
    out = fork.Queue()
    ranks = [fork.Process(target=synced_means, args=(rank, tmp_path / "store", out)) for rank in range(2)]
    for process in ranks:
        process.start()
    results = sorted(out.get(timeout=60) for _ in ranks)
    for process in ranks:
        process.join(timeout=60)
    assert [process.exitcode for process in ranks] == [0, 0]
    for _, as_logged, count_after, float_count in results:
        assert as_logged == pytest.approx(135.5 / 90) and count_after == 90  # the state itself now says 90
        assert float_count == pytest.approx(271 / 181)


class SigtermInTest(L.Callback):
    """Sends this process SIGTERM after the first test batch, as a scheduler would mid-test."""

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_in_test_ends_plain_lightning_with_exit_code_0(tmp_path):
    """StopOnSigterm. Plain Lightning stops a test on SIGTERM with a SIGTERMException that carries no exit code:
    a job that lets it propagate exits 0, without results."""
    with pytest.raises(SIGTERMException) as stopped:
        trainer(tmp_path, callbacks=[SigtermInTest()]).test(Tiny(), verbose=False)
    assert isinstance(stopped.value, SystemExit) and stopped.value.code is None


class HandlerAtSetupAndStart(L.Callback):
    """Installs its own SIGTERM handler in `setup`, and records which one is installed when the test starts."""

    def setup(self, trainer, pl_module, stage) -> None:
        signal.signal(signal.SIGTERM, self.on_signal)

    def on_signal(self, signum, frame) -> None:
        pass

    def on_test_start(self, trainer, pl_module) -> None:
        self.at_start = signal.getsignal(signal.SIGTERM)


def test_lightning_registers_its_own_sigterm_handler_after_setup(tmp_path):
    """keep_sigterm_handler. A handler installed in `setup` is replaced by Lightning's own, registered by the
    private `trainer._signal_connector.register_signal_handlers`, before the stage's first hook; the stage's end
    puts it back."""
    probe = HandlerAtSetupAndStart()
    before = signal.getsignal(signal.SIGTERM)
    try:
        run = trainer(tmp_path, callbacks=[probe])
        assert callable(run._signal_connector.register_signal_handlers)
        run.test(Tiny(), verbose=False)
        assert probe.at_start != probe.on_signal and type(probe.at_start).__name__ == "_HandlersCompose"
        assert signal.getsignal(signal.SIGTERM) == probe.on_signal
    finally:
        signal.signal(signal.SIGTERM, before)


class LoggingSteps(L.Callback):
    def __init__(self) -> None:
        self.seen: list[bool] = []

    def on_train_batch_end(self, trainer, *args, **kwargs) -> None:
        self.seen.append(is_logging_step(trainer))


def test_should_update_logs_follows_log_every_n_steps(tmp_path):
    """is_logging_step. Lightning keeps the rule of its logging steps in the private
    `trainer._logger_connector.should_update_logs`: with log_every_n_steps=2, the 2nd, 4th and 6th step."""
    recorder = LoggingSteps()
    trainer(tmp_path, callbacks=[recorder], max_steps=6, log_every_n_steps=2).fit(Tiny())
    assert recorder.seen == [False, True, False, True, False, True]


HOOKS = [name for name in vars(L.Callback) if name.startswith("on_") or name in ("setup", "teardown")]


class LooksUp(L.Callback):
    """Records every hook Lightning looks up on it; overrides none."""

    def __init__(self) -> None:
        self.looked_up: set[str] = set()

    def __getattribute__(self, name: str):
        if name in HOOKS:
            object.__getattribute__(self, "looked_up").add(name)
        return object.__getattribute__(self, name)


class Records(L.Callback):
    """Records every hook call in order, each hook set on the instance (not the class)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        for hook in HOOKS:
            setattr(self, hook, lambda *args, hook=hook, **kwargs: self.calls.append(hook))


def test_lightning_calls_hooks_a_callback_does_not_override(tmp_path):
    """fast_paths callback dispatch. Lightning looks up and calls the step hooks of a callback that overrides none
    of them."""
    idle = LooksUp()
    trainer(tmp_path, callbacks=[idle], max_steps=2).fit(Tiny())
    assert {"on_train_batch_start", "on_before_backward", "on_train_batch_end"} <= idle.looked_up


def test_skipping_unoverridden_hooks_calls_the_same_hooks_in_the_same_order(tmp_path):
    """With the fast path, callbacks that override hooks on their instance (Records) or their class (LoggingSteps)
    get the same calls in the same order as from Lightning's own dispatch, through fit and test; an idle callback
    is not even looked up."""
    seen = {}
    for name, paths in {"lightning": contextlib.nullcontext, "fast path": fast_paths_on}.items():
        records, idle, steps = Records(), LooksUp(), LoggingSteps()
        module = Tiny()
        run = trainer(tmp_path / name, callbacks=[records, idle, steps], max_steps=6, log_every_n_steps=2)
        with paths():
            run.fit(module)
            run.test(module)
        seen[name] = (records.calls, steps.seen, bool(idle.looked_up & {"on_train_batch_start"}))
    assert len(seen["lightning"][0]) == 60 and seen["lightning"][1] == [False, True] * 3
    assert seen["fast path"][:2] == seen["lightning"][:2]
    assert seen["lightning"][2] and not seen["fast path"][2]


def test_with_a_profiler_every_callback_hook_is_still_timed(tmp_path):
    """The callback fast path steps aside while a profiler runs (`debug=profiler`): its report times each hook."""
    run = trainer(tmp_path, callbacks=[LooksUp()], max_steps=2, profiler="simple")
    with fast_paths_on():
        run.fit(Tiny())
    assert any(name.startswith("[Callback]LooksUp.on_train_batch_start") for name in run.profiler.recorded_durations)


MODULE_HOOKS = [*HOOKS, "training_step", "validation_step", "test_step", "backward", "optimizer_step",
                "optimizer_zero_grad", "configure_gradient_clipping", "on_before_batch_transfer",
                "transfer_batch_to_device", "on_after_batch_transfer"]  # fmt: skip


class FxNames(Tiny):
    """Records (hook, `_current_fx_name` inside it) for every hook Lightning calls on it, and logs from the step
    and batch-end hooks (which `self.log` allows by `_current_fx_name`)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str | None]] = []
        for hook in MODULE_HOOKS:
            method = getattr(self, hook, None)
            if callable(method):
                setattr(self, hook, self._recorded(hook, method))

    def _recorded(self, hook, method):
        def recorded(*args, **kwargs):
            self.calls.append((hook, self._current_fx_name))
            output = method(*args, **kwargs)
            if hook in ("training_step", "on_train_batch_end"):
                self.log(f"logged_in_{hook}", 1.0)
            return output

        return recorded

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)

    def test_dataloader(self) -> DataLoader:
        return self.train_dataloader()


def test_lightning_wraps_every_module_hook_call_in_a_profiler_context(tmp_path, monkeypatch):
    """fast_paths module, strategy and DataModule hooks called directly. With no profiler (PassThroughProfiler),
    Lightning still opens a profiler context, named after the hook, around every module and strategy hook call of a
    training step."""
    from lightning.pytorch.profilers import PassThroughProfiler

    opened = []
    lightning_profile = PassThroughProfiler.profile
    monkeypatch.setattr(
        PassThroughProfiler, "profile", lambda self, name: opened.append(name) or lightning_profile(self, name)
    )
    trainer(tmp_path, max_steps=2).fit(FxNames())
    assert {
        "[LightningModule]FxNames.on_train_batch_start",
        "[Strategy]SingleDeviceStrategy.training_step",
        "[Strategy]SingleDeviceStrategy.backward",
        "[LightningModule]FxNames.optimizer_step",
    } <= set(opened)


def test_direct_hook_calls_call_the_same_hooks_with_the_same_fx_names(tmp_path):
    """With the workaround, the module sees the same hook calls in the same order, each with the same
    `_current_fx_name`, and `self.log` works where Lightning allows it, through fit and test."""
    seen = {}
    for name, paths in {"lightning": contextlib.nullcontext, "workaround": fast_paths_on}.items():
        module = FxNames()
        run = trainer(tmp_path / name, max_steps=3, log_every_n_steps=1)
        with paths():
            run.fit(module)
            logged = sorted(run.logged_metrics)
            run.test(module)
        seen[name] = (module.calls, logged)
    calls, logged = seen["lightning"]
    assert ("training_step", "training_step") in calls and ("optimizer_step", "optimizer_step") in calls
    assert ("on_train_batch_end", "on_train_batch_end") in calls and len(calls) > 60
    assert logged == ["logged_in_on_train_batch_end", "logged_in_training_step"]
    assert seen["workaround"] == seen["lightning"]


class BatchHookData(L.LightningDataModule):
    """Scales each batch in its `on_after_batch_transfer`, counting the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.ones(8, 4)), batch_size=2)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        self.calls += 1
        return [batch[0] * 2]


def test_direct_datamodule_hook_calls_transform_the_same_batches(tmp_path):
    weights = {}
    for name, paths in {"lightning": contextlib.nullcontext, "workaround": fast_paths_on}.items():
        torch.manual_seed(0)
        module, data = Tiny(), BatchHookData()
        with paths():
            trainer(tmp_path / name, max_steps=3).fit(module, data)
        weights[name] = (data.calls, module.layer.weight.detach().clone())
    assert weights["lightning"][0] == 3
    assert weights["workaround"][0] == 3 and torch.equal(weights["workaround"][1], weights["lightning"][1])


def test_with_a_profiler_every_hook_call_is_still_timed(tmp_path):
    """The fast paths step aside while a profiler runs (`debug=profiler`): its report still times each hook."""
    run = trainer(tmp_path, max_steps=2, profiler="simple")
    with fast_paths_on():
        run.fit(FxNames())
    assert {"[LightningModule]FxNames.on_train_batch_start", "[Strategy]SingleDeviceStrategy.training_step"} <= set(
        run.profiler.recorded_durations
    )


def test_model_parallel_strategy_refuses_a_module_without_configure_model():
    """configure_model_counts_as_overridden. ModelParallelStrategy.setup refuses a LightningModule that does not
    override `configure_model`, before it touches the model (no process group needed to see it)."""
    strategy = ModelParallelStrategy()
    strategy.accelerator = CPUAccelerator()
    strategy._lightning_module = Tiny()
    with pytest.raises(TypeError, match="you are required to override the `configure_model"):
        strategy.setup(None)


def test_model_parallel_strategy_refuses_64_true_as_a_flag():
    """model_parallel_precision. The accelerator connector refuses `precision="64-true"` with ModelParallelStrategy
    (and takes the same precision as a DoublePrecision plugin)."""
    with pytest.raises(ValueError, match=r"does not support `Fabric\(\.\.\., precision='64-true'\)`"):
        L.Trainer(strategy=ModelParallelStrategy(), precision="64-true", accelerator="cpu", devices=2, logger=False)
    precision, plugins = model_parallel_precision("64-true")
    trainer = L.Trainer(
        strategy=ModelParallelStrategy(),
        precision=precision,
        plugins=plugins,
        accelerator="cpu",
        devices=2,
        logger=False,
    )
    assert isinstance(trainer.strategy.precision_plugin, DoublePrecision)


def test_private_empty_planner_reads_a_distributed_checkpoint_without_a_process_group(tmp_path):
    """read_distributed_checkpoint, stored_tensor_shapes, stored_file_sizes. The public `dcp.load` fills only the keys
    it is given; torch's private empty planner rebuilds everything from the metadata, whose keys are
    `<entry>.<name>`, and which says where each entry lies."""
    import torch.distributed.checkpoint as dcp

    saved = {
        "state_dict": {"net.weight": torch.arange(6.0).reshape(2, 3)},
        "optimizer_0": {"param_groups": [{"lr": 0.1}]},
    }
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    nothing: dict = {}
    dcp.load(nothing, checkpoint_id=tmp_path, no_dist=True)
    assert nothing == {}
    loaded = read_distributed_checkpoint(tmp_path)
    assert torch.equal(loaded["state_dict"]["net.weight"], saved["state_dict"]["net.weight"])
    assert loaded["optimizer_0"]["param_groups"] == [{"lr": 0.1}]
    assert stored_tensor_shapes(tmp_path, "state_dict") == {"net.weight": (torch.Size([2, 3]), torch.float32)}
    # where the entries lie: each file ends with its last one
    assert stored_file_sizes(tmp_path) == {"__0_0.distcp": (tmp_path / "__0_0.distcp").stat().st_size}


def test_model_parallel_rekeys_optimizer_state_by_module_order():
    """optimizer_states_keyed_in_group_order. Two param groups (weights, then biases) number the parameters
    0.weight, 1.weight, 0.bias, 1.bias; Lightning maps index i to the module's i-th parameter (0.weight, 0.bias,
    ...), so the state of 1.weight lands on 0.bias."""
    from lightning.fabric.strategies.model_parallel import _rekey_optimizer_state_if_needed

    module = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    weights, biases = [module[0].weight, module[1].weight], [module[0].bias, module[1].bias]
    optimizer = torch.optim.Adam([{"params": weights}, {"params": biases}])
    module(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    rekeyed = _rekey_optimizer_state_if_needed(optimizer.state_dict(), module)
    assert rekeyed["state"]["0.bias"]["exp_avg"].shape == module[1].weight.shape
    with optimizer_states_keyed_in_group_order(module, [optimizer]):
        import lightning.fabric.strategies.model_parallel as fabric_model_parallel

        fixed = fabric_model_parallel._rekey_optimizer_state_if_needed(optimizer.state_dict(), module)
    assert fixed["state"]["1.weight"]["exp_avg"].shape == module[1].weight.shape
    assert fixed["param_groups"][1]["params"] == ["0.bias", "1.bias"]


class LogsEverything(Tiny):
    """Logs a per-step value, an epoch mean and a torchmetrics Metric in training, and a value in test."""

    def __init__(self) -> None:
        super().__init__()
        self.total = SumMetric()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.total.update(batch[0].sum())
        self.log("step_loss", loss, on_step=True, on_epoch=False)
        self.log("epoch_loss", loss, on_step=False, on_epoch=True, batch_size=len(batch[0]) + batch_idx)
        self.log("total", self.total, on_step=False, on_epoch=True)
        return loss


def test_lightning_log_rebuilds_the_accumulator_on_every_call(monkeypatch):
    """fast_paths self.log without redundant moves. Every `log` call moves the value's accumulator to the value's
    device, and the move rebuilds the accumulator's metadata although nothing moves."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection, _ResultMetric

    moves = []
    lightning_move = _ResultMetric.to

    def counted(self, *args, **kwargs):
        moves.append(args)
        return lightning_move(self, *args, **kwargs)

    monkeypatch.setattr(_ResultMetric, "to", counted)
    results = _ResultCollection(training=True)
    for _ in range(3):
        results.log("training_step", "loss", torch.tensor(1.0), on_step=True, on_epoch=False, batch_size=1)
    assert moves == [(torch.device("cpu"),)] * 3
    metric = results["training_step.loss"]
    metadata = metric.meta
    lightning_move(metric, torch.device("cpu"))
    assert metric.meta is not metadata and metric.meta == metadata


def test_logging_without_redundant_moves_logs_the_same_values(tmp_path, monkeypatch):
    """With the workaround, step values, sample-weighted epoch means and a logged Metric come out as Lightning's own
    gives them, with one move of Lightning's instead of 21; a move to another device still moves (the meta device
    stands in for a GPU)."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection, _ResultMetric

    seen, moves = {}, []
    lightning_move = _ResultMetric.to

    def counted(self, *args, **kwargs):
        moves.append(args)
        return lightning_move(self, *args, **kwargs)

    monkeypatch.setattr(_ResultMetric, "to", counted)  # Lightning's, counted: what the fast path falls back to
    for name, paths in {"lightning": contextlib.nullcontext, "workaround": fast_paths_on}.items():
        moves.clear()
        torch.manual_seed(0)
        run = trainer(tmp_path / name, max_steps=6, log_every_n_steps=1)
        with paths():
            run.fit(LogsEverything())
        seen[name] = {key: value.item() for key, value in run.callback_metrics.items()}
        seen[f"{name} moves"] = len(moves)
    assert seen["workaround"] == seen["lightning"] and set(seen["lightning"]) == {"step_loss", "epoch_loss", "total"}
    # 3 values logged in 6 steps, and 3 moves to the CPU at the end; only the Metric's first log, before it holds
    # its Metric, falls through to Lightning's move.
    assert (seen["lightning moves"], seen["workaround moves"]) == (21, 1)
    results = _ResultCollection(training=True)
    results.log("training_step", "loss", torch.tensor(2.0), on_step=False, on_epoch=True, batch_size=1)
    moved = fast_paths._skip_redundant_moves(lightning_move)(results["training_step.loss"], torch.device("meta"))
    assert moved.value.device == moved.cumulated_batch_size.device == torch.device("meta")


class DoublesInputs(L.LightningDataModule):
    """Tiny's data with an `on_after_batch_transfer` that doubles every batch."""

    def train_dataloader(self) -> DataLoader:
        return Tiny().train_dataloader()

    def on_after_batch_transfer(self, batch: list[torch.Tensor], dataloader_idx: int) -> list[torch.Tensor]:
        return [batch[0] * 2]


class SeesBatches(Tiny):
    def __init__(self) -> None:
        super().__init__()
        self.batches: list[torch.Tensor] = []

    def on_before_batch_transfer(self, batch: list[torch.Tensor], dataloader_idx: int) -> list[torch.Tensor]:
        return [batch[0] + 1]

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.batches.append(batch[0])
        return super().training_step(batch, batch_idx)


def test_lightning_resolves_the_data_hooks_on_every_batch(tmp_path, monkeypatch):
    """fast_paths data hooks looked up once per fit. With a DataModule, every batch asks which of it and the module
    overrides each of the three batch hooks, and each answer inspects both with `is_overridden`."""
    import lightning.pytorch.trainer.connectors.data_connector as data_connector

    checks = []
    lightning_is_overridden = data_connector.is_overridden
    monkeypatch.setattr(
        data_connector, "is_overridden", lambda *args: checks.append(args[0]) or lightning_is_overridden(*args)
    )
    trainer(tmp_path, max_steps=4).fit(Tiny(), datamodule=DoublesInputs())
    assert checks.count("transfer_batch_to_device") == 4 * 2  # the DataModule's and the module's, per batch


def test_data_hooks_looked_up_once_run_the_same_hooks(tmp_path):
    """With the workaround, the module's `on_before_batch_transfer` and the DataModule's `on_after_batch_transfer`
    both run on every batch, as with Lightning's own lookup."""
    seen = {}
    for name, paths in {"lightning": contextlib.nullcontext, "workaround": fast_paths_on}.items():
        module = SeesBatches()
        with paths():
            trainer(tmp_path / name, max_steps=4).fit(module, datamodule=DoublesInputs())
        seen[name] = torch.stack(module.batches)
    expected = (torch.stack(Tiny().train_dataloader().dataset.tensors[0].split(2)) + 1) * 2
    assert torch.equal(seen["lightning"], expected) and torch.equal(seen["workaround"], expected)


def test_torchmetrics_wraps_update_through_wrap_update():
    """LeanUpdateMetric. torchmetrics wraps `update` with the overridable `Metric._wrap_update` (also when a metric
    is copied), keeps the update count and `compute()` cache as plain attributes, and its own wrapper writes both
    through `__setattr__` on every update."""

    class Writes(SumMetric):
        def __setattr__(self, name, value):
            if name in ("_update_count", "_computed"):
                object.__getattribute__(self, "__dict__").setdefault("writes", []).append(name)
            super().__setattr__(name, value)

    stock = Writes()
    stock.__dict__["writes"] = []
    stock.update(torch.tensor(1.0))
    assert sorted(stock.writes) == ["_computed", "_update_count"]
    assert {"_update_count", "_computed"} <= set(vars(stock))

    class Wrapped(SumMetric):
        def _wrap_update(self, update):
            return lambda *args: "wrapped"

    assert Wrapped().update(1.0) == "wrapped" and copy.deepcopy(Wrapped()).update(1.0) == "wrapped"


def test_lean_update_metrics_count_updates_and_refresh_compute():
    """TopKAccuracy and SampleSum (LeanUpdateMetric) count their updates, recompute after an update, keep no graph
    of what they add, and do so in a deep copy too."""
    for paths in (contextlib.nullcontext, fast_paths_on):  # torchmetrics' own wrapper, then the lean one
        accuracy, total = TopKAccuracy(k=1), SampleSum()
        logits = torch.tensor([[2.0, 1.0], [0.0, 3.0]], requires_grad=True)
        with paths():
            for metric in (accuracy, copy.deepcopy(accuracy)):
                metric.update(logits, torch.tensor([0, 0]))
                assert metric.compute().item() == 0.5
                metric.update(logits, torch.tensor([0, 1]))
                assert metric.compute().item() == 0.75 and metric.update_count == 2
            total.update(logits.sum())
            assert total.update_called and not total.total.requires_grad


def count_state_checks(monkeypatch) -> list[int]:
    """Counts ModelCheckpoint's `_should_skip_saving_checkpoint` calls (the trainer-state check)."""
    checks = []
    lightning_check = ModelCheckpoint._should_skip_saving_checkpoint
    monkeypatch.setattr(
        ModelCheckpoint, "_should_skip_saving_checkpoint", lambda self, t: checks.append(1) or lightning_check(self, t)
    )
    return checks


def test_model_checkpoint_checks_the_trainer_state_on_every_batch(tmp_path, monkeypatch):
    """LeanModelCheckpoint. Without a step or time trigger, ModelCheckpoint still checks the trainer's state at the
    end of every training batch (4 here), then at the epoch's end, where it saves."""
    checks = count_state_checks(monkeypatch)
    callback = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}-{step}", save_top_k=-1)
    trainer(tmp_path, max_epochs=1, callbacks=[callback]).fit(Tiny())
    assert len(checks) == BATCHES_PER_EPOCH + 1 and sorted(os.listdir(tmp_path)) == ["epoch=0-step=4.ckpt"]


@pytest.mark.parametrize("every_n_train_steps", [None, 3])
def test_lean_model_checkpoint_saves_what_lightnings_saves(tmp_path, monkeypatch, every_n_train_steps):
    """With and without a step trigger, LeanModelCheckpoint writes the files Lightning's ModelCheckpoint writes, under
    Lightning's state key; without a trigger it skips the check of each batch."""
    checks = count_state_checks(monkeypatch)
    saved, keys, counts = {}, {}, {}
    for kind in (ModelCheckpoint, LeanModelCheckpoint):
        checks.clear()
        dirpath = tmp_path / kind.__name__
        callback = kind(
            dirpath=dirpath, filename="{epoch}-{step}", save_top_k=-1, every_n_train_steps=every_n_train_steps
        )
        with fast_paths_on():
            trainer(tmp_path, max_epochs=2, callbacks=[callback]).fit(Tiny())
        saved[kind], counts[kind] = sorted(os.listdir(dirpath)), len(checks)
        keys[kind] = list(torch.load(dirpath / saved[kind][-1], weights_only=False)["callbacks"])
    assert saved[ModelCheckpoint] == saved[LeanModelCheckpoint]
    assert keys[ModelCheckpoint] == keys[LeanModelCheckpoint] and keys[ModelCheckpoint][0].startswith(
        "ModelCheckpoint{"
    )
    skipped = 0 if every_n_train_steps else 2 * BATCHES_PER_EPOCH
    assert counts[ModelCheckpoint] - counts[LeanModelCheckpoint] == skipped
    # A step trigger replaces the epoch-end saves.
    expected = (
        ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt"]
        if every_n_train_steps
        else ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]
    )
    assert saved[ModelCheckpoint] == expected


class FailsInValidation(Tiny):
    """Tiny whose validation inside fit fails at its second batch; its loaders each have 2 persistent workers."""

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        if batch_idx == 1:
            raise ValueError("a bad batch")

    def train_dataloader(self) -> DataLoader:
        data = TensorDataset(torch.linspace(-1, 1, 32).view(8, 4))
        return DataLoader(data, batch_size=2, num_workers=2, persistent_workers=True)

    val_dataloader = train_dataloader


def workers_after_a_failed_validation(tmp_path, callbacks=()) -> list:
    """The worker processes the loaders still hold after validation failed inside fit."""
    run = trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, callbacks=list(callbacks))
    with pytest.raises(ValueError, match="a bad batch"):
        run.fit(FailsInValidation())
    iterators = [loader._iterator for loader in (run.train_dataloader, run.val_dataloaders)]
    return [w for iterator in iterators if iterator is not None for w in iterator._workers if w.is_alive()]


def test_an_error_leaves_persistent_loader_workers_running(tmp_path):
    workers = workers_after_a_failed_validation(tmp_path)
    assert len(workers) == 2  # the training loader's
    for worker in workers:  # what the garbage collector would stop, seconds late
        worker.terminate()


def test_loader_workers_stop_stops_them_when_the_error_comes(tmp_path):
    assert workers_after_a_failed_validation(tmp_path, [LoaderWorkersStop()]) == []
