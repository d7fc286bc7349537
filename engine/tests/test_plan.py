"""The batch and LR plan: pure functions, then the real CLI in dry-run mode."""

import json
import logging
import math
from dataclasses import replace

import pytest

from conftest import ENGINE_CONF, TESTS, batches, engine_section, in_process, performance, read_json
from scaleup.checkpoints.io import load_checkpoint
from scaleup.checkpoints.resume import log_changes
from scaleup.distributed.fsdp import Sharding
from scaleup.errors import UserError
from scaleup.finetune import InitialWeights
from scaleup.plan.batch import resolve_batch, total_steps
from scaleup.plan.checks import batchnorm_warning
from scaleup.plan.lr import LRSchedule, lr_factor
from scaleup.plan.resolve import Plan, build_plan
from scaleup.plan.topology import Topology


@pytest.mark.parametrize(
    ("world", "accum", "per_device"), [(1, 1, 256), (2, 1, 128), (4, 2, 32), (8, 4, 8), (32, 8, 1)]
)
def test_per_device_batch_is_global_over_world_times_accumulation(world, accum, per_device):
    batch = resolve_batch(256, None, world, accum)
    assert (batch.per_device, batch.global_) == (per_device, 256)


def test_per_device_mode_grows_the_global_batch():
    assert resolve_batch(None, 32, 8, 2).global_ == 512


def test_a_global_batch_must_split_into_devices_times_accumulation():
    """100 splits into 2 devices x 2 steps of 25 samples, not into 3 x 2 = 6; 102 does (17 each). The message is
    test_errors' (the matrix's "indivisible batch")."""
    assert resolve_batch(100, None, 2, 2).per_device == 25
    assert resolve_batch(102, None, 3, 2).per_device == 17
    with pytest.raises(UserError):
        resolve_batch(100, None, 3, 2)


@pytest.mark.parametrize(("global_", "per_device"), [(None, None), (64, 32)])
def test_exactly_one_batch_size(global_, per_device):
    with pytest.raises(UserError, match="exactly one"):
        resolve_batch(global_, per_device, 2, 1)


@pytest.mark.parametrize(("rule", "factor"), [("linear", 4.0), ("sqrt", 2.0), ("none", 1.0)])
def test_scaling_rules(rule, factor):
    assert lr_factor(1024, 256, rule) == pytest.approx(factor)


def test_goyal_warmup_and_step_decay():
    """0.1 at 256 -> 3.2 at 8192, reached after 5 epochs of linear warmup from 0.1, then /10 at epoch 30.
    ImageNet's 1,281,167 images make 156 steps of 8192 per epoch: warmup is 780 steps."""
    schedule = LRSchedule(lr_factor(8192, 256, "linear"), 780, 90 * 156, "step", (30 * 156,), 0.1)
    lr = {step: 0.1 * schedule.factor_at(step) for step in (0, 390, 780, 4679, 4680)}
    assert lr == pytest.approx({0: 0.1, 390: 1.65, 780: 3.2, 4679: 3.2, 4680: 0.32})


@pytest.mark.parametrize(
    ("rule", "global_batch", "warmup", "lrs"),
    [
        # Below the base batch (256): the scaled LR, 0.1 x 32/256, from the first step, then the cosine over all
        # 3 x 312 steps; no warmup, which would only hold it flat.
        ("linear", 32, 0, {0: 0.0125, 468: 0.00625, 936: 0.0}),
        # At the base batch: the base LR at step 0, decaying from there over the 3 x 39 steps.
        ("linear", 256, 0, {0: 0.1, 39: 0.075, 78: 0.025, 117: 0.0}),
        # rule=none: the base LR at any batch, so no warmup either.
        ("none", 1024, 0, {0: 0.1, 9: 0.075, 18: 0.025, 27: 0.0}),
        # Above it: from the base LR up to 0.1 x 1024/256 = 0.4 over the warmup epoch (9 steps), then the cosine.
        ("linear", 1024, 9, {0: 0.1, 3: 0.2, 9: 0.4, 18: 0.2, 27: 0.0}),
    ],
)
def test_warmup_only_ramps_up_to_a_peak_above_the_base_lr(rule, global_batch, warmup, lrs):
    """A new user's run at the default batch planned "19 / 19 (cosine decay)" and kept the LR at its peak to the end:
    a warmup from the base LR to a peak no higher was a flat hold, and the decay came after the run."""
    plan = plan_for(batches={"global_batch_size": global_batch}, lr_schedule={"base_batch_size": 256, "rule": rule})
    assert plan.warmup_steps == warmup
    schedule = plan.schedule()
    assert {step: 0.1 * schedule.factor_at(step) for step in lrs} == pytest.approx(lrs, abs=1e-12)


def test_a_schedule_never_ramps_down():
    with pytest.raises(ValueError, match=r"a warmup of 10 steps needs a peak above the base LR, not x0\.125"):
        LRSchedule(lr_factor(32, 256, "linear"), warmup_steps=10, total_steps=100)


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
    assert total_steps(19, -1, 500) == 500  # max_epochs=-1: no epoch limit
    with pytest.raises(UserError, match="trains without end"):
        total_steps(19, -1, -1)


def plan_for(**overrides):
    kwargs = dict(
        topology=Topology("gpu", 4, 2),
        trainer={"accumulate_grad_batches": 2, "max_epochs": 3},
        batches={"global_batch_size": 512},
        lr_schedule={"base_batch_size": 256, "rule": "linear", "warmup_epochs": 1, "decay": "cosine"},
        base_lrs={"SGD/decay": 0.1},
        seed=1,
        dataset_sizes={"train": 10_000, "val": 100, "test": 100},
        has_batchnorm=True,
        strategy="ddp",
    )
    kwargs.update(overrides)
    kwargs["trainer"] = engine_section("trainer/default", **kwargs["trainer"])
    kwargs["lr_schedule"] = engine_section("lr_schedule/linear", **kwargs["lr_schedule"])
    kwargs["batches"] = batches(**kwargs["batches"])
    return build_plan(**kwargs, performance=performance())


def test_plan_numbers():
    plan = plan_for()
    assert (plan.world_size, plan.per_device_batch_size, plan.global_batch_size) == (8, 32, 512)
    assert plan.lr == pytest.approx(0.2)
    assert (plan.steps_per_epoch, plan.warmup_steps, plan.total_steps) == (19, 19, 57)
    # 32 per device is enough per BatchNorm statistic: auto does not sync
    assert (plan.sync_batchnorm, plan.bn_batch_size, plan.base_bn_batch_size) == (False, 32, 256)


def test_sync_batchnorm_refused_on_cpu():
    with pytest.raises(UserError, match="cannot run on CPU"):
        plan_for(topology=Topology("cpu", 2, 1), trainer={"sync_batchnorm": True, "max_epochs": 1})
    assert not plan_for(topology=Topology("cpu", 2, 1)).sync_batchnorm


def test_warmup_epochs_and_steps_are_exclusive():
    with pytest.raises(UserError, match="not both"):
        plan_for(lr_schedule={"warmup_epochs": 1, "warmup_steps": 10})


def test_eval_split_smaller_than_world_is_refused():
    with pytest.raises(UserError, match="val split has 5 samples, fewer than the 8 processes"):
        plan_for(dataset_sizes={"train": 10_000, "val": 5, "test": 100})


def test_dry_run_goyal_plan_for_256_gpus(tmp_path, caplog):
    recipe = ["experiment=goyal_imagenet", "dry_run=true", "trainer.devices=8", "trainer.num_nodes=32"]
    in_process([*recipe, f"hydra.run.dir={tmp_path}"])
    plan = read_json(tmp_path / "plan.json")
    spe = 1_281_167 // 8192
    assert plan["world_size"] == 256 and plan["per_device_batch_size"] == 32 and plan["global_batch_size"] == 8192
    assert math.isclose(plan["lr"], 3.2) and plan["base_lr"] == 0.1 and plan["base_batch_size"] == 256
    assert plan["warmup_steps"] == 5 * spe and plan["total_steps"] == 90 * spe
    assert plan["precision"] == "bf16-mixed" and "sharding" not in plan and "init" not in plan  # no extra's record
    # BN over 32 images per GPU, unsynced, as the recipe was tuned: no SyncBN, no BatchNorm warning
    assert (plan["sync_batchnorm"], plan["bn_batch_size"], plan["base_bn_batch_size"]) == (False, 32, 32)
    log = (tmp_path / "train.log").read_text()
    assert "3.2 @ 8192" in log and "BatchNorm statistics" not in log
    assert not (tmp_path / "checkpoints").exists()
    # A resume over a mesh of 8 processes of an FSDP checkpoint sharded over 2 nodes x 4: the log says what the
    # record's values became; not the launch, which a restarted torchrun counts up. A plan of an earlier version,
    # whose flat sharding and init fields are left out, compares no sharding.
    sharding = {"units": ["net.0", "net.1"], "mesh": [8], "built_on_meta": True}
    now = {**plan, "sharding": sharding}
    sharded = {**now, "sharding": {**sharding, "mesh": [2, 4]}, "launcher_kind": "torchrun", "launcher_restarts": 2}
    earlier = {**plan, "sharding_units": ["net.0"], "sharding_mesh": [2, 4], "init_weights": "net.pt", "init_loaded": 3}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="scaleup"):
        log_changes("last.ckpt", Plan.from_dict(sharded), Plan.from_dict(now))
        log_changes("earlier.ckpt", Plan.from_dict(earlier), Plan.from_dict(now))
    assert "resuming from last.ckpt; changed since: sharding.mesh 2, 4 -> 8\n" in caplog.text
    assert "resuming from earlier.ckpt\n" in caplog.text and "WARNING" not in caplog.text
    assert [record.to_dict() for record in Plan.from_dict(now).records] == [sharding]  # written again as stored
    assert Plan.from_dict(earlier).records == ()
    # plan.json read back typed, as eval, export, resume and the equivalence check read it
    typed = Plan.from_dict({**plan, "from_a_newer_version": 1})
    assert json.loads(json.dumps(typed.to_dict())) == plan and typed.milestones == tuple(plan["milestones"])
    with pytest.raises(UserError, match=r"^the stored plan has no world_size, seed: it was not written by scaleup"):
        Plan.from_dict({key: value for key, value in plan.items() if key not in ("world_size", "seed")})


def test_indivisible_batch_fails_before_anything_is_written(tmp_path):
    with pytest.raises(UserError, match=r"^data\.global_batch_size=64 "):  # the refusal; its text is test_errors'
        in_process(["trainer.devices=3", "trainer.accelerator=cpu", f"hydra.run.dir={tmp_path}"])
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize(
    ("global_", "world", "cap", "accumulation", "per_device"),
    [
        (256, 1, 32, 8, 32),  # an 8-GPU recipe on 1 GPU
        (256, 8, 32, 1, 32),  # on the 8 GPUs it was written for, the cap does not bite
        (256, 8, 64, 1, 32),  # a cap above the share is no contradiction
        (256, 4, 32, 2, 32),
        (100, 1, 30, 4, 25),  # the smallest accumulation with an exact split
        (96, 2, 20, 3, 16),
        (64, 1, 3, 32, 2),
    ],
)
def test_cap_derives_the_smallest_exact_accumulation(global_, world, cap, accumulation, per_device):
    batch = resolve_batch(global_, None, world, None, cap)
    assert (batch.accumulation, batch.per_device, batch.global_) == (accumulation, per_device, global_)


def test_cap_with_the_same_accumulation_spelled_out_is_fine():
    assert resolve_batch(256, None, 1, 8, 32).accumulation == 8


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            (256, None, 1, 4, 32),
            r"trainer.accumulate_grad_batches=4 contradicts data.max_per_device_batch_size=32: "
            r"a global batch of 256 on 1 device\(s\) needs accumulation 8",
        ),
        ((None, 16, 2, None, 32), "data.per_device_batch_size=16 fixes the per-device batch itself"),
        ((64, None, 3, None, 8), "data.global_batch_size=64 does not split evenly over 3 device"),
    ],
)
def test_contradictory_cap_settings_name_the_conflict(args, message):
    with pytest.raises(UserError, match=message):
        resolve_batch(*args)


@pytest.mark.parametrize(
    ("data_cfg", "trainer_cfg", "strategy", "conflict"),
    [
        ({"global_batch_size": None, "per_device_batch_size": 32}, {}, "ddp", "data.per_device_batch_size=32"),
        ({"global_batch_size": 512}, {"accumulate_grad_batches": 1}, "ddp", "trainer.accumulate_grad_batches=1"),
        ({"global_batch_size": 512}, {}, "fsdp", "strategy=fsdp shards the model"),
    ],
)
def test_auto_cap_refuses_what_fixes_the_split_already(data_cfg, trainer_cfg, strategy, conflict):
    with pytest.raises(UserError, match=f"max_per_device_batch_size=auto .* but {conflict}"):
        plan_for(
            batches={**data_cfg, "max_per_device_batch_size": "auto"},
            trainer={"max_epochs": 1, **trainer_cfg},
            strategy=strategy,
        )


CAPPED = dict(
    topology=Topology("gpu", 1, 1),
    trainer={"max_epochs": 3},
    batches={"global_batch_size": 256, "max_per_device_batch_size": 32},
)
AUTO = dict(trainer={"max_epochs": 3}, batches={"global_batch_size": 512, "max_per_device_batch_size": "auto"})


def test_cap_in_the_plan():
    plan = plan_for(**CAPPED)
    assert (plan.per_device_batch_size, plan.accumulate_grad_batches, plan.global_batch_size) == (32, 8, 256)
    assert (plan.max_per_device_batch_size, plan.bn_batch_size, plan.base_bn_batch_size) == (32, 32, 256)
    assert (plan.sync_batchnorm, plan.sync_batchnorm_rule) == (False, "one_process")
    assert plan.total_steps == 3 * (10_000 // 256)  # steps and LR follow the global batch alone


def test_auto_cap_plans_the_global_batch_and_leaves_the_split_to_the_probe():
    plan = plan_for(**AUTO)
    assert (plan.max_per_device_batch_size, plan.global_batch_size, plan.world_size) == ("auto", 512, 8)
    assert plan.bn_batch_size is None and plan.total_steps == 57
    settled = plan.with_per_device_batch(16)
    assert (settled.per_device_batch_size, settled.accumulate_grad_batches, settled.bn_batch_size) == (16, 4, 16)


@pytest.mark.parametrize(
    ("topology", "global_", "sync", "rule"),
    [
        (Topology("gpu", 8, 1), 128, True, "small_batch"),  # 16 per device, below 32
        (Topology("gpu", 8, 1), 256, False, "large_batch"),  # 32 per device
        (Topology("cpu", 2, 1), 32, False, "cpu"),
        (Topology("gpu", 1, 1), 16, False, "one_process"),
    ],
)
def test_sync_batchnorm_auto_decides_by_the_per_device_batch(topology, global_, sync, rule):
    plan = plan_for(topology=topology, trainer={"max_epochs": 1}, batches={"global_batch_size": global_})
    assert (plan.sync_batchnorm, plan.sync_batchnorm_rule) == (sync, rule)
    assert plan.bn_batch_size == (global_ if sync else global_ // topology.world_size)


@pytest.mark.parametrize(
    "train_size, setting, every",
    [(10_000, "auto", 4), (512 * 400, "auto", 50), (512 * 3, "auto", 1), (None, "auto", 50), (10_000, 7, 7)],
)
def test_log_every_n_steps_auto_is_50_or_a_quarter_epoch(train_size, setting, every):
    """19 steps an epoch: every 4; 400 steps: Lightning's 50; 3 steps: every step; sizes unknown (a dry run
    without the files): 50; a number is kept."""
    sizes = {"train": train_size, "val": 100, "test": 100} if train_size else {}
    plan = plan_for(trainer={"max_epochs": 1, "log_every_n_steps": setting}, dataset_sizes=sizes)
    assert plan.log_every_n_steps == every


def test_one_gpu_with_accumulation_warns_that_batchnorm_sees_less_than_the_synced_recipe():
    """An 8-GPU SyncBN recipe (BN over 256) on 1 GPU with a cap of 32: BN normalises each micro-batch of 32."""
    one_gpu = plan_for(
        topology=Topology("gpu", 1, 1),
        trainer={"max_epochs": 1},
        batches={"global_batch_size": 256, "max_per_device_batch_size": 32},
    )
    assert batchnorm_warning(one_gpu, norm_key="model.net.norm") == (
        "BatchNorm statistics come from 32 samples (the micro-batch), not the 256 of an optimizer step (accumulation "
        "normalises each micro-batch): the recipe was tuned with 256, so results will differ from it. Options: a "
        "larger data.max_per_device_batch_size (less accumulation), or model.net.norm=group (no batch statistics)"
    )
    # A network without the example's `norm` setting is not told to set it.
    assert batchnorm_warning(one_gpu).endswith("Options: a larger data.max_per_device_batch_size (less accumulation)")
    eight_synced = plan_for(
        topology=Topology("gpu", 8, 1),
        trainer={"max_epochs": 1, "sync_batchnorm": True},
        batches={"global_batch_size": 256},
    )
    assert eight_synced.bn_batch_size == 256 and batchnorm_warning(eight_synced) is None
    eight_unsynced = plan_for(
        topology=Topology("gpu", 8, 1), trainer={"max_epochs": 1}, batches={"global_batch_size": 256}
    )
    assert "Options: trainer.sync_batchnorm=true (256 per statistic)" in batchnorm_warning(eight_unsynced)


def test_a_plan_made_before_the_data_is_there_says_what_is_unknown():
    plan = plan_for(dataset_sizes={})
    assert (plan.steps_per_epoch, plan.total_steps, plan.warmup_steps) == (None, None, None)
    assert plan.dataset_sizes == {}


def test_no_batchnorm_no_bn_batch():
    plan = plan_for(has_batchnorm=False)
    assert (plan.has_batchnorm, plan.bn_batch_size, batchnorm_warning(plan)) == (False, None, None)


def test_early_stopping_is_in_the_plan():
    plan = plan_for(
        early_stopping={
            "_target_": "lightning.pytorch.callbacks.EarlyStopping",
            "monitor": "val/acc",
            "mode": "max",
            "patience": 4,
        }
    )
    assert early_stopping(plan) == ("val/acc", "max", 4) and early_stopping(plan_for()) == (None, None, None)
    # What the entry leaves out is the callback's own default (Lightning's EarlyStopping: min, patience 3).
    plan = plan_for(early_stopping={"_target_": "lightning.pytorch.callbacks.EarlyStopping", "monitor": "val/loss"})
    assert early_stopping(plan) == ("val/loss", "min", 3)


def early_stopping(plan):
    return (plan.early_stopping_monitor, plan.early_stopping_mode, plan.early_stopping_patience)


def test_a_plan_of_an_older_version_reads_its_numbers_and_leaves_its_sentences_out():
    """Before 0.3 the plan stored sentences (the v0.2.0 fixture's plan): they are left out, the fields made from
    them since take their defaults, and the numbers a resume checks (the global batch) are read as stored."""
    old = load_checkpoint(TESTS / "fixtures" / "v0.2.0" / "last.ckpt")["scaleup"]["plan"]
    assert old["sync_batchnorm_reason"] == "auto: one process, nothing to sync" and old["launcher"] == "one process"
    plan = Plan.from_dict(old)
    assert (plan.global_batch_size, plan.total_steps, plan.dataset_sizes["test"]) == (64, 3, 360)
    assert (plan.sync_batchnorm_rule, plan.launcher_kind, plan.epoch_limit_flag) == ("", "", None)
    rows = dict(plan.rows())
    assert rows["SyncBatchNorm"] == "off (unknown)" and rows["steps per epoch"] == "3" and "launcher" not in rows


RANDOMNESS = (
    "augmentation by (seed, epoch, sample): any topology; dropout and other in-model draws by (seed, step, "
    "micro-batch offset): any topology with micro-batches of {}"
)
EARLY_STOPPING = {"_target_": "lightning.pytorch.callbacks.EarlyStopping", "monitor": "val/acc", "mode": "max"}
# The plan as printed (and in train.log) for a capped plan, an auto plan with early stopping, and a plan made
# before the data is there for a model without BatchNorm: every row's wording in one place, where the tests above
# check the fields behind them.
PRINTED = {
    "capped": (
        CAPPED,
        [
            ("world size", "1 = 1 node(s) x 1 gpu"),
            ("per-device batch", "32 (cap 32)"),
            ("accumulation", "8 (derived from the per-device cap)"),
            ("global batch", "256 (global mode)"),
            ("learning rate", "0.1 @ 256 -> 0.1 @ 256 (linear)"),
            (
                "warmup / total steps",
                "0 / 117 (cosine decay); no warmup: the scaled LR is not above the base LR",
            ),
            ("steps per epoch", "39"),
            ("BatchNorm batch", "32 (the per-device micro-batch); tuned at 256"),
            ("SyncBatchNorm", "off (auto: one process, nothing to sync)"),
            ("precision / strategy", "bf16-mixed / ddp"),
            ("TF32 / channels_last", "on / off"),
            ("seed", "1"),
            ("random numbers", RANDOMNESS.format(32)),
            ("data", "train 10000, val 100, test 100"),
        ],
    ),
    "auto, early stopping": (
        {**AUTO, "early_stopping": {**EARLY_STOPPING, "patience": 4}},
        [
            ("world size", "8 = 2 node(s) x 4 gpu"),
            ("per-device batch", "auto: the largest exact split of 64 that fits, probed on every device at start"),
            ("accumulation", "derived from the probe (global batch / (world size x per-device))"),
            ("global batch", "512 (global mode)"),
            ("learning rate", "0.1 @ 256 -> 0.2 @ 512 (linear)"),
            ("warmup / total steps", "19 / 57 (cosine decay)"),
            ("steps per epoch", "19"),
            ("BatchNorm batch", "the probed micro-batch; tuned at 256"),
            (
                "SyncBatchNorm",
                "off (auto: 64 samples per device >= 32 are enough per statistic (decided before the probe, on its "
                "largest split))",
            ),
            ("precision / strategy", "bf16-mixed / ddp"),
            ("TF32 / channels_last", "on / off"),
            (
                "early stopping",
                "val/acc (max, patience 4): may end the run before step 57; the LR schedule still spans all 57",
            ),
            ("seed", "1"),
            ("random numbers", RANDOMNESS.format("the probed micro-batch")),
            ("data", "train 10000, val 100, test 100"),
        ],
    ),
    "no data yet, no BatchNorm": (
        {"dataset_sizes": {}, "has_batchnorm": False},
        [
            ("world size", "8 = 2 node(s) x 4 gpu"),
            ("per-device batch", "32"),
            ("accumulation", "2"),
            ("global batch", "512 (global mode)"),
            ("learning rate", "0.1 @ 256 -> 0.2 @ 512 (linear)"),
            ("warmup / total steps", "unknown / unknown (cosine decay)"),
            ("steps per epoch", "unknown"),
            ("BatchNorm batch", "- (no BatchNorm layers)"),
            ("SyncBatchNorm", "off (no BatchNorm layers)"),
            ("precision / strategy", "bf16-mixed / ddp"),
            ("TF32 / channels_last", "on / off"),
            ("seed", "1"),
            ("random numbers", RANDOMNESS.format(32)),
            ("data", "unknown until the data is there (the data module cannot state its sizes)"),
        ],
    ),
}


@pytest.mark.parametrize("name", PRINTED)
def test_the_plan_as_printed(name):
    settings, rows = PRINTED[name]
    assert plan_for(**settings).rows() == rows


def test_the_rows_made_from_the_launch_sharding_and_initial_weights_fields():
    """The rows of the fields the plan's makers fill in after build_plan (clusters.py, fsdp.py, finetune.py)."""
    plan = replace(
        plan_for(trainer={"max_epochs": 3, "accumulate_grad_batches": 2, "overfit_batches": 3}),
        launcher_kind="torchrun",
        launcher_restarts=1,
        records=(
            Sharding(tuple(f"net.{i}" for i in range(8)), ("net",), (2, 4), 3 * 2**20, 2**20 // 4, True, "step"),
            InitialWeights("net.pt", "a state_dict", "net", 20, 18, 2, 6, True),
        ),
    )
    rows = dict(plan.rows())
    assert rows["launcher"] == "torchrun, restart 1: ranks from RANK, LOCAL_RANK, GROUP_RANK"
    # 3 micro-batches of the sequential loader, in steps of 2
    assert (plan.steps_per_epoch, plan.epoch_limit_flag, plan.epoch_limit_value) == (2, "overfit_batches", 3)
    assert rows["steps per epoch"] == "2 (trainer.overfit_batches=3)"
    assert rows["sharding"] == (
        "8 unit(s) (net.0, net.1, net.2, net.3, net.4, net.5, ... (8 in all)), then the root(s) net; parameters "
        "0.25 MiB per rank of 3.00 MiB (gradients and optimizer state shard alike); mesh 2 node(s) x 4: sharded "
        "within a node, replicated across nodes; built on the meta device, each rank fills its shards with the "
        "ordinary build's values; gradients reduced once per optimizer step (whole gradients held between "
        "micro-batches: +3.00 MiB per rank)"
    )
    assert rows["initial weights"] == (
        "net.pt (a state_dict) into net: 18 of 20 tensors loaded, 2 left as built; 6 parameters frozen "
        "(init.freeze); BatchNorm in eval mode: running statistics fixed (init.freeze_bn)"
    )
    # a resume opens no file: no kind, nothing loaded
    resumed = dict(InitialWeights("net.pt", module="net", tensors=20).rows(plan))["initial weights"]
    assert resumed == "net.pt: not loaded, the run resumes from its checkpoint (its trained weights)"


def test_a_group_of_your_own_takes_the_engines_yaml_defaults_and_a_missing_key_is_one_line(tmp_path):
    """The engine's YAML groups are the one source of defaults. A changed default (here the decay of a copy of
    lr_schedule/linear.yaml, on the user's search path beside the engine's groups) reaches the plan through a group
    of the user's own that starts from it, with no second default in the code to change; a group that leaves a key
    out is refused by name."""
    groups = tmp_path / "lr_schedule"
    groups.mkdir()
    (groups / "stepped.yaml").write_text(
        (ENGINE_CONF / "lr_schedule" / "linear.yaml").read_text().replace("decay: cosine", "decay: step")
    )
    (groups / "mine.yaml").write_text("defaults: [stepped, _self_]\nrule: sqrt\n")
    (groups / "partial.yaml").write_text("base_batch_size: 64\nrule: sqrt\n")
    searchpath = f"hydra.searchpath=[file://{tmp_path}]"
    in_process([searchpath, "lr_schedule=mine", "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}"])
    plan = read_json(tmp_path / "run" / "plan.json")
    assert (plan["decay"], plan["milestones"], plan["scaling_rule"]) == ("step", [30, 60, 80], "sqrt")
    with pytest.raises(UserError) as refused:
        in_process([searchpath, "lr_schedule=partial", "dry_run=true", f"hydra.run.dir={tmp_path / 'partial'}"])
    assert str(refused.value).startswith(
        "lr_schedule.base_bn_batch_size is missing: the engine's lr_schedule options set it; start a group of your "
        "own from one of them (`defaults: [<option>, _self_]` at its top) or set it; "
        "lr_schedule.warmup_epochs is missing"
    )
