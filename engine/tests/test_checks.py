"""Start-up pitfall checks and the DDP options, on the functions that decide them."""

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed import DistStoreError
from torch.utils.data import DataLoader

from conftest import batches, engine_section, performance
from scaleup.compat.launch import SpawnDDPStrategy
from scaleup.distributed.launch import build_strategy
from scaleup.plan.checks import own_train_loader_warning, pitfall_warnings
from scaleup.plan.resolve import build_plan
from scaleup.plan.topology import Topology
from testbed.data import DigitsDataModule

DDP_OPTIONS = {
    "timeout_minutes": 90,
    "bucket_cap_mb": 100,
    "gradient_as_bucket_view": True,
    "static_graph": True,
    "find_unused_parameters": False,
}


def plan(accelerator="gpu", devices=4, global_batch=64, rule="linear", base_batch=64, precision="32-true", **kw):
    return build_plan(
        topology=Topology(accelerator, devices, 1),
        trainer=engine_section(
            "trainer/default", max_epochs=2, precision=precision, sync_batchnorm=kw.get("sync_batchnorm", "auto")
        ),
        batches=batches(**{"global_batch_size": global_batch}),
        lr_schedule=engine_section(
            "lr_schedule/linear", base_batch_size=base_batch, rule=rule, warmup_epochs=kw.get("warmup_epochs", 0)
        ),
        performance=performance(),
        base_lrs={"SGD/decay": 0.1},
        seed=0,
        dataset_sizes={"train": 1000, "val": 100, "test": 100},
        has_batchnorm=True,
        strategy="ddp",
    )


def warnings_for(p, **kw):
    return " | ".join(pitfall_warnings(p, **{"has_batchnorm": True, "num_workers": 4, "data_in_memory": False, **kw}))


def test_no_warning_for_the_recipe():
    assert warnings_for(plan()) == ""


def test_unscaled_lr_with_another_batch_warns():
    assert "rule=none: the LR 0.1 tuned for a batch of 64 is used unchanged with a global batch of 256" in (
        warnings_for(plan(global_batch=256, rule="none"))
    )


def test_unsynced_batchnorm_on_small_per_device_batches_warns():
    assert "BatchNorm runs unsynced on 4 processes with 16 samples per device" in warnings_for(
        plan(sync_batchnorm=False)
    )
    assert warnings_for(plan(sync_batchnorm=False, global_batch=256)) == ""  # 64 per device is plenty


def test_no_loader_workers_on_multi_gpu_warns_unless_in_memory():
    assert "data.num_workers=0 on a multi-GPU run" in warnings_for(plan(), num_workers=0)
    assert warnings_for(plan(), num_workers=0, data_in_memory=True) == ""


def test_warmup_longer_than_the_run_warns_only_where_the_lr_ramps():
    ramping = plan(warmup_epochs=3, base_batch=32)  # peak 2 x the base LR
    assert "the warmup (45 steps) is longer than the run (30 steps)" in warnings_for(ramping)
    # At the base batch there is no warmup (0 steps): nothing to warn about, however long warmup_epochs is.
    assert warnings_for(plan(warmup_epochs=3)) == ""


@pytest.fixture
def ddp_in_this_process() -> Iterator[None]:
    """Undoes what a DDP start in this process leaves: the process group, the variables Lightning sets
    (MASTER_PORT, LOCAL_RANK, ...) and torch's thread count."""
    environ, threads = dict(os.environ), torch.get_num_threads()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(threads)


class DDPModule(Callback):
    """Keeps what the DistributedDataParallel that Lightning wrapped the model in was built with."""

    built: dict[str, Any] | None = None  # stays None where training ran in another process

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        ddp = trainer.strategy.model
        self.built = {
            "bucket_cap_mb": ddp.bucket_bytes_cap / 2**20,
            "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
            "static_graph": ddp.static_graph,
            "find_unused_parameters": ddp.find_unused_parameters,
        }


def quiet_trainer(strategy: DDPStrategy, devices: int, **kwargs: Any) -> Trainer:
    """A CPU Trainer with `strategy` that writes and prints nothing of its own (no logger, checkpoint, bar)."""
    return Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def test_ddp_options_reach_the_ddp_module(ddp_in_this_process):
    """A step on one CPU process with the strategy the ddp config gives: the DistributedDataParallel module Lightning
    builds has the config's bucket size, graph and gradient options. Rank 0 is this process (popen: the script's
    own process trains; spawn would train in a child, and the callback here would see nothing)."""
    strategy, name = build_strategy(engine_section("strategy/ddp", **DDP_OPTIONS), world_size=8, multirun=False)
    assert name == "ddp" and type(strategy) is DDPStrategy
    ddp = DDPModule()
    quiet_trainer(strategy, devices=1, max_steps=1, callbacks=[ddp]).fit(BoringModel())
    assert ddp.built == {key: value for key, value in DDP_OPTIONS.items() if key != "timeout_minutes"}


def test_ddp_timeout_is_how_long_a_rank_waits_for_the_others(ddp_in_this_process):
    """strategy.timeout_minutes=0.01: rank 0 of 2, alone, gives up on its peer after 0.6 s (in a thread: without the
    config's timeout it would wait torch's 30 minutes)."""
    options = {**DDP_OPTIONS, "timeout_minutes": 0.01}
    strategy, _ = build_strategy(engine_section("strategy/ddp", **options), world_size=2, multirun=False)
    trainer = quiet_trainer(strategy, devices=2)
    refused = []

    def rank_zero_alone() -> None:
        try:
            trainer.strategy.setup_environment()  # what each rank runs as fit starts: joins the process group
        except DistStoreError as error:
            refused.append(str(error))

    waiting = threading.Thread(target=rank_zero_alone, daemon=True)
    start = time.monotonic()
    waiting.start()
    waiting.join(timeout=10)
    assert not waiting.is_alive(), "rank 0 still waits for its peer after 10 s"
    assert time.monotonic() - start >= 0.6 and refused and "1/2 clients joined" in refused[0], refused


def test_sweeps_spawn_and_single_process_stays_plain():
    """The start method has no public accessor on Lightning's strategy: a sweep gets the engine's spawn strategy
    (its spawned runs: test_lightning_workarounds' SpawnDDPStrategy tests, test_search)."""
    strategy, name = build_strategy(engine_section("strategy/ddp", **DDP_OPTIONS), world_size=2, multirun=True)
    assert name == "ddp_spawn" and isinstance(strategy, SpawnDDPStrategy)
    assert build_strategy(engine_section("strategy/ddp", **DDP_OPTIONS), world_size=1, multirun=False) == (
        "auto",
        "auto",
    )


class OwnLoader(DigitsDataModule):
    """A data module that builds its own train loader, as Lightning's docs write one: its own shuffle."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["train"], batch_size=16, shuffle=True)


def test_a_data_module_that_builds_its_own_train_loader_is_named_at_start_up():
    assert own_train_loader_warning(DigitsDataModule()) is None
    assert own_train_loader_warning(OwnLoader()) == (
        "OwnLoader builds its own train loader: unless its sampler is train_sampler()'s GlobalBatchSampler, every "
        "rank reads the whole split (Lightning adds no DistributedSampler here), so 1-device and N-device runs will "
        "differ. Return map-style datasets from build_splits() and let the base class make the loader"
    )
