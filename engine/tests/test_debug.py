"""The debug= options: each runs, and the plan (steps per epoch, warmup, total) is the run Lightning makes of it."""

import io
import json
import logging
from typing import ClassVar

import lightning as L
import pytest
import torch

from conftest import in_process
from scaleup.checkpoints.io import load_checkpoint

QUIET = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "model.net.width=8"]


def plan_of(*overrides: str, tmp_path) -> dict:
    return in_process([*overrides, "dry_run=true", "trainer.accelerator=cpu", f"hydra.run.dir={tmp_path}"])


@pytest.mark.parametrize(
    ("option", "steps_per_epoch", "warmup", "total", "limit"),
    [
        (None, 19, 19, 228, (None, None)),  # digits: 1257 // 64 = 19 global batches; 12 epochs
        ("fdr", 1, 1, 1, ("fast_dev_run", 1)),
        ("overfit", 3, 3, 60, ("overfit_batches", 3)),
        ("limit", 4, 4, 12, ("limit_train_batches", 4)),
        ("profiler", 19, 19, 19, (None, None)),
        ("anomaly", 19, 19, 19, (None, None)),
    ],
)
def test_the_plan_follows_the_debug_flags(option, steps_per_epoch, warmup, total, limit, tmp_path):
    ramping = "lr_schedule.base_batch_size=32"  # a peak above the base LR, so a warmup of warmup_epochs=1
    plan = plan_of(*([f"debug={option}"] if option else []), ramping, tmp_path=tmp_path)
    assert (plan["steps_per_epoch"], plan["warmup_steps"], plan["total_steps"]) == (steps_per_epoch, warmup, total)
    assert (plan["epoch_limit_flag"], plan["epoch_limit_value"]) == limit


def test_flags_count_micro_batches_and_an_epochs_last_step(tmp_path):
    """limit_train_batches counts loader batches: 5 micro-batches at accumulation 2 are 3 optimizer steps, the
    last one on a single micro-batch (Lightning steps at the end of an epoch)."""
    plan = plan_of("trainer.limit_train_batches=5", "trainer.accumulate_grad_batches=2", tmp_path=tmp_path)
    assert (plan["steps_per_epoch"], plan["total_steps"]) == (3, 36)
    plan = plan_of("trainer.limit_train_batches=0.5", "trainer.max_steps=50", tmp_path=tmp_path / "share")
    assert (plan["steps_per_epoch"], plan["total_steps"]) == (9, 50)  # int(19 * 0.5); max_steps ends it


def run(option: str, tmp_path, *overrides: str) -> tuple[dict, dict, str]:
    """A real run of `debug=<option>`: its metrics, its plan and its log."""
    metrics = in_process([f"debug={option}", *QUIET, *overrides, f"hydra.run.dir={tmp_path}"])
    return metrics, json.loads((tmp_path / "plan.json").read_text()), (tmp_path / "train.log").read_text()


@pytest.mark.slow  # an end-to-end run
def test_fast_dev_run_runs_one_batch_of_each_and_saves_nothing(tmp_path):
    metrics, plan, _ = run("fdr", tmp_path)
    assert plan["total_steps"] == 1
    assert metrics["test/samples"] == 64 and metrics["val/samples"] == 64  # one batch each
    assert not list(tmp_path.glob("checkpoints/*.ckpt"))  # Lightning suppresses checkpoints in this mode


@pytest.mark.slow  # an end-to-end run
def test_overfit_plans_its_short_epochs_and_keeps_the_sequential_sampler_quiet(tmp_path):
    _, plan, log = run("overfit", tmp_path, "trainer.max_epochs=4", "lr_schedule.base_batch_size=32")
    assert (plan["steps_per_epoch"], plan["warmup_steps"], plan["total_steps"]) == (3, 3, 12)
    assert load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == 12  # the plan is what ran
    assert "not GlobalBatchSampler" not in log  # Lightning's own SequentialSampler, on purpose
    assert "longer than the run" not in log  # the warmup ends after the first (short) epoch


@pytest.mark.slow  # an end-to-end run
def test_limit_runs_short_epochs_as_planned(tmp_path):
    metrics, plan, _ = run("limit", tmp_path, "trainer.max_epochs=2")
    assert load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == plan["total_steps"] == 8
    assert metrics["test/samples"] == 2 * 64  # limit_test_batches=2


@pytest.mark.slow  # an end-to-end run
def test_profiler_reports_where_the_time_goes(tmp_path):
    report = io.StringIO()
    handler = logging.StreamHandler(report)
    lightning_log = logging.getLogger("lightning.pytorch")  # Lightning's own console logger prints the report
    lightning_log.addHandler(handler)
    try:
        run("profiler", tmp_path, "trainer.limit_train_batches=2", "trainer.limit_val_batches=1")
    finally:
        lightning_log.removeHandler(handler)
    assert "FIT Profiler Report" in report.getvalue() and "run_training_batch" in report.getvalue()


class AnomalyProbe(L.Callback):
    """Records whether torch's anomaly detection is on while a training batch runs."""

    seen: ClassVar[list[bool]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        AnomalyProbe.seen.append(torch.is_anomaly_enabled())


@pytest.mark.slow  # an end-to-end run
def test_anomaly_detection_is_on_during_training(tmp_path):
    AnomalyProbe.seen.clear()
    probe = [f"+callbacks.anomaly_probe._target_={__name__}.AnomalyProbe", "trainer.limit_train_batches=2"]
    run("anomaly", tmp_path, *probe, "trainer.limit_val_batches=1")
    assert AnomalyProbe.seen == [True, True]
    assert not torch.is_anomaly_enabled()  # and off again afterwards
