"""The batch and LR plan: pure functions, then the real CLI in dry-run mode."""

import math

import pytest

from conftest import check, read_json, run
from scaleup.engine.callbacks.lr_scaling import LRSchedule, lr_factor
from scaleup.engine.errors import UserError
from scaleup.engine.plan import Topology, build_plan, resolve_batch, total_steps


@pytest.mark.parametrize(
    ("world", "accum", "per_device"), [(1, 1, 256), (2, 1, 128), (4, 2, 32), (8, 4, 8), (32, 8, 1)]
)
def test_per_device_batch_is_global_over_world_times_accumulation(world, accum, per_device):
    batch = resolve_batch(256, None, world, accum)
    assert (batch.per_device, batch.global_) == (per_device, 256)


def test_per_device_mode_grows_the_global_batch():
    assert resolve_batch(None, 32, 8, 2).global_ == 512


def test_indivisible_global_batch_names_the_numbers():
    with pytest.raises(UserError, match=r"global_batch_size=100 does not divide into 3 device\(s\) x 2 .* = 6"):
        resolve_batch(100, None, 3, 2)


@pytest.mark.parametrize(("global_", "per_device"), [(None, None), (64, 32)])
def test_exactly_one_batch_size(global_, per_device):
    with pytest.raises(UserError, match="exactly one"):
        resolve_batch(global_, per_device, 2, 1)


@pytest.mark.parametrize(("rule", "factor"), [("linear", 4.0), ("sqrt", 2.0), ("none", 1.0)])
def test_scaling_rules(rule, factor):
    assert lr_factor(1024, 256, rule) == pytest.approx(factor)


def test_goyal_warmup_and_step_decay():
    """0.1 at 256 -> 3.2 at 8192, reached after 5 epochs of linear warmup from 0.1, then /10 at epoch 30."""
    spe = 1_281_167 // 8192
    schedule = LRSchedule(lr_factor(8192, 256, "linear"), 5 * spe, 90 * spe, "step", (30 * spe,), 0.1)
    lr = {step: 0.1 * schedule.factor_at(step) for step in (0, 5 * spe // 2, 5 * spe, 30 * spe - 1, 30 * spe)}
    assert lr[0] == pytest.approx(0.1)
    assert lr[5 * spe // 2] == pytest.approx(0.1 + 3.1 * (5 * spe // 2) / (5 * spe))
    assert lr[5 * spe] == pytest.approx(3.2)
    assert lr[30 * spe - 1] == pytest.approx(3.2)
    assert lr[30 * spe] == pytest.approx(0.32)


def test_cosine_decay_ends_at_zero():
    schedule = LRSchedule(4.0, 10, 110, "cosine")
    assert schedule.factor_at(10) == pytest.approx(4.0)
    assert schedule.factor_at(60) == pytest.approx(2.0)
    assert schedule.factor_at(110) == pytest.approx(0.0, abs=1e-12)


def test_total_steps_follows_lightning_rules():
    assert total_steps(19, 12, -1) == 228
    assert total_steps(19, 12, 100) == 100
    assert total_steps(19, None, 50) == 50
    assert total_steps(19, None, -1) == 19_000  # Lightning's default max_epochs=1000


def plan_for(**overrides):
    kwargs = dict(
        topology=Topology("gpu", 4, 2),
        trainer_cfg={"accumulate_grad_batches": 2, "max_epochs": 3},
        data_cfg={"global_batch_size": 512},
        lr_cfg={"base_batch_size": 256, "rule": "linear", "warmup_epochs": 1, "decay": "cosine"},
        base_lrs={"SGD/decay": 0.1},
        seed=1,
        dataset_sizes={"train": 10_000, "val": 100, "test": 100},
        has_batchnorm=True,
        strategy="ddp",
    )
    kwargs.update(overrides)
    return build_plan(**kwargs)


def test_plan_numbers():
    plan = plan_for()
    assert (plan.world_size, plan.per_device_batch_size, plan.global_batch_size) == (8, 32, 512)
    assert plan.lr == pytest.approx(0.2)
    assert (plan.steps_per_epoch, plan.warmup_steps, plan.total_steps) == (19, 19, 57)
    assert plan.sync_batchnorm  # GPU, 8 processes, BatchNorm in the net


def test_sync_batchnorm_refused_on_cpu():
    with pytest.raises(UserError, match="cannot run on CPU"):
        plan_for(topology=Topology("cpu", 2, 1), trainer_cfg={"sync_batchnorm": True, "max_epochs": 1})
    assert not plan_for(topology=Topology("cpu", 2, 1)).sync_batchnorm


def test_warmup_epochs_and_steps_are_exclusive():
    with pytest.raises(UserError, match="not both"):
        plan_for(lr_cfg={"warmup_epochs": 1, "warmup_steps": 10})


def test_eval_split_smaller_than_world_is_refused():
    with pytest.raises(UserError, match="val split has 5 samples, fewer than the 8 processes"):
        plan_for(dataset_sizes={"train": 10_000, "val": 5, "test": 100})


def test_dry_run_goyal_plan_for_256_gpus(tmp_path):
    result = check(
        run(
            [
                "experiment=goyal_imagenet",
                "dry_run=true",
                "trainer.devices=8",
                "trainer.num_nodes=32",
                f"hydra.run.dir={tmp_path}",
            ]
        )
    )
    plan = read_json(tmp_path / "plan.json")
    spe = 1_281_167 // 8192
    assert plan["world_size"] == 256 and plan["per_device_batch_size"] == 32 and plan["global_batch_size"] == 8192
    assert math.isclose(plan["lr"], 3.2) and plan["base_lr"] == 0.1 and plan["base_batch_size"] == 256
    assert plan["warmup_steps"] == 5 * spe and plan["total_steps"] == 90 * spe
    assert plan["sync_batchnorm"] is True and plan["precision"] == "bf16-mixed"
    assert "3.2 @ 8192" in result.stdout + result.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_indivisible_batch_fails_before_any_process_starts(tmp_path):
    result = run(["trainer.devices=3", "trainer.accelerator=cpu", f"hydra.run.dir={tmp_path}"], timeout=60)
    assert result.returncode == 2
    assert "data.global_batch_size=64 does not divide into 3 device(s)" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "plan.json").exists()
