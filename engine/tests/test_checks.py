"""Start-up pitfall checks and the DDP options, on the functions that decide them."""

from datetime import timedelta

import pytest
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from conftest import batches, engine_section, performance, train_config
from scaleup.distributed.launch import build_strategy
from scaleup.errors import UserError
from scaleup.plan.checks import check_config, own_train_loader_warning, pitfall_warnings
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


def test_config_mistakes_are_refused():
    with pytest.raises(UserError, match="16-mixed needs a GPU"):
        check_config(train_config(), plan(accelerator="cpu", devices=1, precision="16-mixed"))


def test_ddp_options_reach_the_strategy():
    strategy, name = build_strategy(engine_section("strategy/ddp", **DDP_OPTIONS), world_size=8, multirun=False)
    assert name == "ddp" and isinstance(strategy, DDPStrategy)
    assert strategy._timeout == timedelta(minutes=90) and strategy._start_method == "popen"
    assert strategy._ddp_kwargs == {k: v for k, v in DDP_OPTIONS.items() if k != "timeout_minutes"}


def test_sweeps_spawn_and_single_process_stays_plain():
    strategy, name = build_strategy(engine_section("strategy/ddp", **DDP_OPTIONS), world_size=2, multirun=True)
    assert name == "ddp_spawn" and strategy._start_method == "spawn"
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
