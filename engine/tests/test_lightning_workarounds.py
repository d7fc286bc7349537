"""Canaries of engine/src/scaleup/compat/ and of the features that read Lightning's private state: one per
workaround, each on plain Lightning WITHOUT it, and each workaround against Lightning's own code.

Each canary asserts the Lightning 2.6.6 behaviour (or private API) that made its workaround necessary. When one fails
after an upgrade, Lightning changed that behaviour: delete the workaround its docstring names, and this canary.
Private names are imported inside the tests that need them: a name a release removed fails its own canary only.
"""

import gc
import multiprocessing
import os
import signal
import socket
import time
import warnings
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.precision import DoublePrecision
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from scaleup.callbacks.loop_repairs import UNRESUMABLE_LOADER_WARNING, LoopRepairs, install_fit_loop_fixes
from scaleup.checkpoints.io import load_checkpoint
from scaleup.compat.dcp import read_distributed_checkpoint, stored_file_sizes, stored_tensor_shapes
from scaleup.compat.launch import PortPerLaunch, SpawnDDPStrategy
from scaleup.compat.loggers import add_summaries
from scaleup.compat.precision import model_parallel_precision
from scaleup.distributed.fsdp import FSDPStrategy, load_one_file_checkpoint, recompute_in_backward
from scaleup.distributed.process_group import shut_down_process_group

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


class RecordsTheProcessGroup(Tiny):
    """Tiny, writing into `record_dir` whether its rank's process group is up when its state_dict is taken: in a
    spawned worker of a run without checkpoints, that is when Lightning collects the worker's results."""

    def __init__(self, record_dir: Path) -> None:
        super().__init__()
        self.record_dir = record_dir

    def state_dict(self, *args, **kwargs) -> dict:
        (self.record_dir / f"rank{self.global_rank}").write_text(str(dist.is_initialized()))
        return super().state_dict(*args, **kwargs)


def process_group_up_at_collection(tmp_path, monkeypatch, strategy: DDPStrategy) -> list[str]:
    """Fits RecordsTheProcessGroup on 2 spawned CPU processes; whether each rank's process group was up when
    Lightning collected its results. The weights trained in the workers came back to the main process."""
    monkeypatch.delenv("MASTER_PORT", raising=False)  # the spawn launcher sets it in this process
    model = RecordsTheProcessGroup(tmp_path)
    initial = model.layer.weight.detach().clone()
    fit = trainer(tmp_path, devices=2, strategy=strategy, max_epochs=1)
    fit.fit(model)
    assert fit.state.finished and not torch.equal(model.layer.weight, initial)
    return [(tmp_path / f"rank{rank}").read_text() for rank in (0, 1)]


@pytest.mark.slow
def test_spawn_worker_leaves_the_process_group_up(tmp_path, monkeypatch):
    """SpawnDDPStrategy's LeaveProcessGroup: Lightning's spawn worker collects its results, and returns, with the
    process group still up."""
    assert process_group_up_at_collection(tmp_path, monkeypatch, DDPStrategy(start_method="spawn")) == ["True"] * 2


@pytest.mark.slow
def test_spawn_workers_leave_the_process_group_before_their_results_are_collected(tmp_path, monkeypatch):
    """ddp_spawn (SpawnDDPStrategy): every worker has left the process group together (its teardown hook) before
    Lightning collects its results, and the results still reach the main process."""
    strategy = SpawnDDPStrategy(on_exit=shut_down_process_group)
    assert process_group_up_at_collection(tmp_path, monkeypatch, strategy) == ["False"] * 2


def listening(port: int = 0) -> socket.socket:
    """A server socket on `port` (0: a free one), as another process's would be."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: the last launch's closed connections
    server.bind(("", port))
    server.listen()
    return server


def test_lightning_launches_again_on_its_first_port_even_when_it_is_taken(monkeypatch):
    """Canary of PortPerLaunch: Lightning's environment meets on MASTER_PORT as its first launch left it, taken or
    not (its launcher then fails in the rendezvous: address already in use)."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    with listening() as taken:
        monkeypatch.setenv("MASTER_PORT", str(taken.getsockname()[1]))  # as a launch leaves it
        assert LightningEnvironment().main_port == taken.getsockname()[1]


def test_a_port_you_set_is_kept_and_a_chosen_one_replaced_once_taken(monkeypatch):
    """PortPerLaunch: MASTER_PORT as you set it is the port, taken or not; the port a launch chose is kept while it
    is free and replaced once another process has it."""
    with listening() as yours:
        monkeypatch.setenv("MASTER_PORT", str(yours.getsockname()[1]))
        assert PortPerLaunch().main_port == yours.getsockname()[1]
    monkeypatch.delenv("MASTER_PORT")
    environment = PortPerLaunch()
    chosen = environment.main_port
    monkeypatch.setenv("MASTER_PORT", str(chosen))  # as Lightning's launcher sets it
    assert environment.main_port == chosen
    with listening(chosen):
        assert environment.main_port not in (chosen, -1)


@pytest.mark.slow
def test_a_spawned_job_launches_again_on_a_free_port_when_its_port_was_taken(tmp_path, monkeypatch):
    """ddp_spawn (SpawnDDPStrategy): a job that starts its processes again (its test after its fit, a sweep's next
    trial) does so on a free port when another process took the port of its last launch."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
    model = RecordsTheProcessGroup(tmp_path)
    run = trainer(tmp_path, devices=2, strategy=SpawnDDPStrategy(on_exit=shut_down_process_group), max_epochs=1)
    run.fit(model)
    first = int(os.environ["MASTER_PORT"])
    with listening(first):
        run.test(model)
    assert run.state.finished and int(os.environ["MASTER_PORT"]) != first


def test_log_hyperparams_with_metrics_adds_a_scalar_point(tmp_path):
    """add_summaries: log_hyperparams(params, metrics) also writes every metric as a scalar point."""
    logger = TensorBoardLogger(tmp_path, name="", version="")
    logger.log_hyperparams({"lr": 0.1}, metrics={"test_loss": 0.5}, step=7)
    logger.finalize("success")
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("test_loss")] == [(7, 0.5)]


def test_add_summaries_writes_the_hparams_tab_after_lightning_closed_its_writer(tmp_path):
    """add_summaries: Lightning closes its SummaryWriter at a stage's end; the summary goes into an event file of its
    own in the same directory, which TensorBoard reads with the others."""
    from torch.utils.tensorboard.summary import hparams

    logger = TensorBoardLogger(tmp_path, name="", version="")
    logger.log_metrics({"test_loss": 0.5}, step=7)
    logger.finalize("success")
    assert logger.experiment.file_writer is None
    add_summaries(logger, list(hparams({"lr": 0.1}, {"test_loss": 0.0})), step=7)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")
    assert [(e.step, e.value) for e in events.Scalars("test_loss")] == [(7, 0.5)]


def test_ema_average_is_built_before_the_model_moves_to_its_device(tmp_path):
    """EMA (device): EMAWeightAveraging builds its average in setup, before the strategy moves the model, on
    `pl_module.device` unless given a `device` (trainer.py's `on_training_device` gives the training device's)."""
    order = []

    class Moving(SingleDeviceStrategy):
        def model_to_device(self) -> None:
            order.append("model_to_device")
            super().model_to_device()

    class Recording(EMAWeightAveraging):
        def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
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
    """LoopRepairs: resumed from a checkpoint at an epoch's last batch, Lightning does not count the next
    epoch as started, so a checkpoint inside it says the epoch before, and resuming that repeats the epoch."""
    trainer(tmp_path, max_epochs=1, callbacks=[save_every(BATCHES_PER_EPOCH, tmp_path)]).fit(Tiny())
    trainer(tmp_path, max_steps=6, callbacks=[save_every(2, tmp_path)]).fit(Tiny(), ckpt_path=tmp_path / "step=4.ckpt")
    inside = loops(tmp_path / "step=6.ckpt")
    assert inside["epoch_progress"]["current"]["ready"] == inside["epoch_progress"]["current"]["completed"] == 1
    resumed = trainer(tmp_path, max_epochs=3)
    resumed.fit(Tiny(), ckpt_path=tmp_path / "step=6.ckpt")
    assert resumed.global_step > 3 * BATCHES_PER_EPOCH  # epoch 1 trained again


def test_an_epoch_resumed_from_its_predecessors_last_batch_ends_counted_as_processed_only(tmp_path):
    """LoopRepairs: resumed from a checkpoint at an epoch's last batch, Lightning does not count the next epoch as
    started, so the checkpoint at that epoch's end has ready and started one behind processed; resumed from it,
    plain Lightning trains another number of steps than the run asked for (found by the kill -9 test:
    test_resume.py::test_kill_9_never_leaves_a_broken_last_checkpoint ended 8 steps short). LoopRepairs counts the
    epoch as started, and the run ends at its planned step."""
    trainer(tmp_path, max_epochs=1, callbacks=[save_every(BATCHES_PER_EPOCH, tmp_path)]).fit(Tiny())
    end = ModelCheckpoint(dirpath=tmp_path, filename="end", save_on_train_epoch_end=True)
    trainer(tmp_path, max_epochs=2, callbacks=[end]).fit(Tiny(), ckpt_path=tmp_path / f"step={BATCHES_PER_EPOCH}.ckpt")
    epochs = loops(tmp_path / "end.ckpt")["epoch_progress"]["current"]
    assert epochs["ready"] == epochs["started"] == epochs["completed"] == epochs["processed"] - 1 == 1
    steps = {}
    for name, callbacks in (("plain", []), ("repaired", [LoopRepairs()])):
        run = trainer(tmp_path / name, max_epochs=3, callbacks=callbacks)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the unresumable-loader warning
            run.fit(Tiny(), ckpt_path=tmp_path / "end.ckpt")
        steps[name] = run.global_step
    assert steps["plain"] != 3 * BATCHES_PER_EPOCH and steps["repaired"] == 3 * BATCHES_PER_EPOCH, steps


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


def resumed_batches(tmp_path, ckpt, repaired=False, **limits) -> tuple[list[tuple[int, int]], int, torch.Tensor]:
    """(epoch, batch_idx) of each batch a resume from `ckpt` trains, its last step and its final weight; `repaired`:
    with LoopRepairs and the fit loop of compat/lightning_2_6.py, as the engine's Trainer has them."""
    batches, model = Batches(), Tiny()
    run = trainer(tmp_path / "resumed", callbacks=[batches, *([LoopRepairs()] if repaired else [])], **limits)
    if repaired:
        install_fit_loop_fixes(run)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unresumable-loader warning
        run.fit(model, ckpt_path=ckpt)
    return batches.seen, run.global_step, model.layer.weight.detach()


def test_max_steps_resume_from_an_epoch_end_reenters_the_finished_epoch(tmp_path):
    """compat/lightning_2_6.py's FitLoop: with max_steps, Lightning restores a run whose epoch ran to its end as one
    to continue inside that epoch: one batch past its end, then the epoch counts as done a second time."""
    seen, step, _ = resumed_batches(tmp_path, epoch_end_checkpoint(tmp_path), max_epochs=2, max_steps=100)
    assert seen == [(0, BATCHES_PER_EPOCH)] and step == BATCHES_PER_EPOCH + 1


def test_resume_from_an_epoch_that_max_steps_cut_short_drops_its_rest(tmp_path):
    """LoopRepairs: Lightning counts an epoch that max_steps cut short (2 of 4 batches) as processed; trained
    further without max_steps, the resume starts the next epoch and never trains the rest."""
    seen, step, _ = resumed_batches(tmp_path, epoch_end_checkpoint(tmp_path, max_steps=2), max_epochs=2)
    assert seen == [(1, i) for i in range(BATCHES_PER_EPOCH)] and step == 2 + BATCHES_PER_EPOCH


@pytest.mark.parametrize("where", ["in on_train_epoch_end", "after fit"])
def test_epoch_end_resume_with_max_steps_trains_what_a_resume_without_trains(tmp_path, where):
    ckpt = epoch_end_checkpoint(tmp_path, where)
    without = resumed_batches(tmp_path, ckpt, max_epochs=2)  # Lightning's own resume
    with_max_steps = resumed_batches(tmp_path, ckpt, repaired=True, max_epochs=2, max_steps=100)
    assert without[:2] == with_max_steps[:2] == ([(1, i) for i in range(BATCHES_PER_EPOCH)], 2 * BATCHES_PER_EPOCH)
    assert torch.equal(without[2], with_max_steps[2])


@pytest.mark.parametrize("max_steps", [-1, 100])
def test_epoch_end_resume_trains_the_rest_of_an_epoch_that_max_steps_cut_short(tmp_path, max_steps):
    ckpt = epoch_end_checkpoint(tmp_path, max_steps=2)
    seen, step, _ = resumed_batches(tmp_path, ckpt, repaired=True, max_epochs=2, max_steps=max_steps)
    assert seen == [(0, 2), (0, 3), *[(1, i) for i in range(BATCHES_PER_EPOCH)]] and step == 2 * BATCHES_PER_EPOCH


def test_resume_with_another_accumulation_keeps_the_micro_batch_count(tmp_path):
    """LoopRepairs: a resumed run restores the epoch's batch counter in the checkpoint's micro-batches."""
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
    """JobControl. Plain Lightning stops a test on SIGTERM with a SIGTERMException that carries no exit code:
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
    """compat/lightning_2_6.py SignalConnector. A handler installed in `setup` is replaced by Lightning's own,
    registered by the private `trainer._signal_connector.register_signal_handlers`, before the stage's first hook;
    the stage's end puts it back."""
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


def test_model_parallel_strategy_refuses_a_module_without_configure_model():
    """FSDPStrategy.setup (Strategy.setup for a module it sharded). ModelParallelStrategy.setup refuses a
    LightningModule that does not override `configure_model`, before it touches the model (no process group needed
    to see it)."""
    strategy = ModelParallelStrategy()
    strategy.accelerator = CPUAccelerator()
    strategy._lightning_module = Tiny()
    with pytest.raises(TypeError, match="you are required to override the `configure_model"):
        strategy.setup(None)


def test_fsdp_strategy_sets_up_a_module_without_configure_model_for_fit_and_then_test(tmp_path, monkeypatch):
    """FSDPStrategy.setup, on a 1-process group in this process: Tiny (no configure_model) is sharded and set up for
    fit, and set up again for test after it (sharded already); the checkpoint's keys are the module's own."""
    from torch.distributed.tensor import DTensor

    for key in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)  # Lightning's launcher sets them: put back after the test
    strategy = FSDPStrategy(world_size=1, timeout=timedelta(minutes=1))
    run, model = trainer(tmp_path, strategy=strategy, max_epochs=1), Tiny()
    try:
        run.fit(model)
        run.test(model, verbose=False)
        run.save_checkpoint(tmp_path / "last.ckpt")
    finally:
        shut_down_process_group()
    assert isinstance(model.layer.weight, DTensor) and "test_loss" in run.callback_metrics
    assert sorted(load_checkpoint(tmp_path / "last.ckpt")["state_dict"]) == ["layer.bias", "layer.weight"]


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


def two_group_adam(module: nn.Module) -> torch.optim.Adam:
    """Adam over `module` (two Linear layers) in two param groups, weights then biases, after one step: torch numbers
    the parameters 0.weight, 1.weight, 0.bias, 1.bias."""
    weights, biases = [module[0].weight, module[1].weight], [module[0].bias, module[1].bias]
    optimizer = torch.optim.Adam([{"params": weights}, {"params": biases, "lr": 0.01}])
    module(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return optimizer


def test_model_parallel_rekeys_optimizer_state_by_module_order():
    """FSDPStrategy.load_checkpoint. Lightning maps index i of a one-file checkpoint's optimizer state to the module's
    i-th parameter (0.weight, 0.bias, ...), so the state of 1.weight lands on 0.bias."""
    from lightning.fabric.strategies.model_parallel import _rekey_optimizer_state_if_needed

    module = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    rekeyed = _rekey_optimizer_state_if_needed(two_group_adam(module).state_dict(), module)
    assert rekeyed["state"]["0.bias"]["exp_avg"].shape == module[1].weight.shape


def test_a_one_file_checkpoint_loads_into_a_sharded_module_keyed_by_its_param_groups(tmp_path):
    """load_one_file_checkpoint, as FSDPStrategy resumes a one-file checkpoint: an optimizer of two param groups gets
    each parameter's own moments and each group's own LR, in a sharded module (fully_shard on a 1-process group)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    saved_module = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    saved = two_group_adam(saved_module)
    path = tmp_path / "one.ckpt"
    torch.save({"state_dict": saved_module.state_dict(), "optimizer_states": [saved.state_dict()], "epoch": 3}, path)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        module = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        for layer in (*module, module):
            fully_shard(layer)
        optimizer = two_group_adam(module)
        rest = load_one_file_checkpoint(path, module, [optimizer], strict=True, weights_only=True)
        assert sorted(rest) == ["epoch", "optimizer_states"] and rest["epoch"] == 3
        for (name, param), original in zip(module.named_parameters(), saved_module.parameters(), strict=True):
            assert isinstance(param, DTensor) and torch.equal(param.full_tensor(), original), name
            loaded, expected = optimizer.state[param]["exp_avg"].full_tensor(), saved.state[original]["exp_avg"]
            assert torch.equal(loaded, expected), name
        assert [group["lr"] for group in optimizer.param_groups] == [0.001, 0.01]
    finally:
        dist.destroy_process_group()


class CountingDropout(nn.Dropout):
    """Dropout that counts its forward passes."""

    forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        return super().forward(x)


def test_composable_checkpoint_recomputes_a_module_under_its_own_names():
    """recompute_in_backward (torch.distributed._composable.checkpoint). The module's forward runs again in the
    backward and draws the same dropout mask (the same gradients as without), and its state_dict keys and parameter
    names stay as they were (torch's checkpoint_wrapper would add `_checkpoint_wrapped_module.`)."""
    results = []
    for recompute in (False, True):
        torch.manual_seed(0)
        block = nn.Sequential(nn.Linear(4, 8), CountingDropout(0.5), nn.Linear(8, 1))
        if recompute:
            recompute_in_backward(block)
        block(torch.ones(3, 4)).sum().backward()
        grads = {name: param.grad for name, param in block.named_parameters()}
        results.append((list(block.state_dict()), grads, block[1].forwards))
    (keys, grads, forwards), (recomputed_keys, recomputed_grads, recomputed_forwards) = results
    assert recomputed_keys == keys == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert (forwards, recomputed_forwards) == (1, 2)
    assert all(torch.equal(grads[name], recomputed_grads[name]) for name in keys)


class FailsInValidation(Tiny):
    """Tiny whose validation inside fit fails at its second batch; its loaders each have 2 persistent workers."""

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        if batch_idx == 1:
            raise ValueError("a bad batch")

    def train_dataloader(self) -> DataLoader:
        data = TensorDataset(torch.linspace(-1, 1, 32).view(8, 4))
        return DataLoader(data, batch_size=2, num_workers=2, persistent_workers=True)

    val_dataloader = train_dataloader


def workers_after_a_failed_validation(tmp_path, callbacks=()) -> tuple[L.Trainer, list]:
    """The Trainer, and the processes its fit started that still run, right after validation failed inside fit."""
    run = trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, callbacks=list(callbacks))
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="a bad batch"):
        run.fit(FailsInValidation())
    return run, [worker for worker in multiprocessing.active_children() if worker not in before]


def test_an_error_leaves_persistent_loader_workers_running(tmp_path):
    _, workers = workers_after_a_failed_validation(tmp_path)
    assert len(workers) == 2  # the training loader's
    for worker in workers:  # what the garbage collector would stop, 5 s late each
        worker.terminate()


def test_loop_repairs_stops_them_when_the_error_comes(tmp_path):
    """No loader worker runs once fit has raised, and dropping the Trainer then waits for none (5 s each)."""
    run, workers = workers_after_a_failed_validation(tmp_path, [LoopRepairs()])
    assert workers == []
    started = time.perf_counter()
    del run
    gc.collect()
    assert time.perf_counter() - started < 4  # below one worker's 5 s, above a loaded machine's collection (1.5 s)
