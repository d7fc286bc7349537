"""LR scaling is a factor on each param group's own LR; a scheduler of the module's own is refused."""

import functools

import lightning as L
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import QUICK, in_process, read_json, warmup_cosine
from scaleup.errors import UserError
from scaleup.plan.lr import base_lrs
from scaleup.trainer import probe_trainer
from testbed.models import DigitsCNN
from user_modules import SCHEDULER_REFUSED, CountingClassifier

# Digits: 1257 training samples, 9 global batches of 128 per epoch, 18 steps; the LR warms up over the first 9
# from the base LR (tuned at 64) to twice it, then decays (cosine) to 0.
TWO_GROUPS = [
    *QUICK,
    "model._target_=user_modules.TwoGroupClassifier",
    "data.global_batch_size=128",
    "lr_schedule.base_batch_size=64",
    "lr_schedule.warmup_epochs=1",
    "trainer.log_every_n_steps=1",
]

# One optimizer step on one batch, no validation, a one-batch test.
ONE_STEP = ["trainer.max_steps=1", "trainer.limit_val_batches=0", "trainer.limit_test_batches=1", "logger=none"]


def logged_lrs(run_dir):
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {group: {e.step: e.value for e in events.Scalars(f"lr-SGD/{group}")} for group in ("body", "head")}


@pytest.mark.slow
def test_two_param_groups_keep_their_ratio_through_warmup_decay_and_resume(tmp_path):
    """Trained 1 epoch, stopped, resumed to 2: every logged step has body = 0.1 x head = 0.1 x base x factor."""
    args = [*TWO_GROUPS, f"hydra.run.dir={tmp_path}"]
    in_process([*args, "+callbacks.stop._target_=probes.StopAfterEpochs", "+callbacks.stop.epochs=1"])
    in_process([*args, "ckpt_path=last"])  # the restored param groups carry the LR last set, not the base LR

    plan = read_json(tmp_path / "plan.json")
    assert plan["base_lrs"] == {"SGD/body": pytest.approx(0.01), "SGD/head": 0.1}
    assert plan["base_lr"] is None and plan["lr_factor"] == 2.0 and plan["warmup_steps"] == 9
    assert (
        "x2 @ 128 over 64 (linear): SGD/body 0.01 -> 0.02, SGD/head 0.1 -> 0.2" in (tmp_path / "train.log").read_text()
    )
    lrs = logged_lrs(tmp_path)
    assert sorted(lrs["head"]) == sorted(lrs["body"]) == list(range(18))
    for step, head in lrs["head"].items():
        assert head == pytest.approx(warmup_cosine(step, 0.1, 0.2, 9, 18), rel=1e-6, abs=1e-12), step
        assert lrs["body"][step] == pytest.approx(0.1 * head, rel=1e-6, abs=1e-12), step
    # the base, 4 of 9 warmup steps up, the peak, 4 of 9 decay steps down: hard-coded, not from any formula
    assert [lrs["head"][step] for step in (0, 4, 9, 13)] == pytest.approx([0.1, 0.144444, 0.2, 0.117365], rel=1e-5)


def test_a_returned_scheduler_is_refused_before_anything_is_written(tmp_path):
    """In process; engine/tests/test_errors.py runs the same mistake through train.py for the exit code and stderr."""
    with pytest.raises(UserError) as refused:
        in_process(["model._target_=user_modules.SchedulerClassifier", "dry_run=true", f"hydra.run.dir={tmp_path}"])
    assert str(refused.value) == SCHEDULER_REFUSED
    assert not (tmp_path / "plan.json").exists()


def test_a_run_builds_one_trainer_and_calls_configure_optimizers_once(tmp_path, monkeypatch):
    """The run's Trainer checks the `trainer.*` values, and the plan's param group LRs are read from the optimizers
    Lightning built: no other Trainer, no other call of the module's `configure_optimizers` (which may have effects).
    A dry run too: one probe Trainer, one call of its own."""
    constructed, construct = [], L.Trainer.__init__

    @functools.wraps(construct)  # its signature: the config's schema reads the Trainer's arguments from it
    def counted(self, **arguments):
        constructed.append(self)
        construct(self, **arguments)

    monkeypatch.setattr(L.Trainer, "__init__", counted)
    monkeypatch.setattr(CountingClassifier, "calls", 0)
    counted = ["model._target_=user_modules.CountingClassifier", "model.optimizer.lr=0.05"]
    scaled = ["data.global_batch_size=128", "lr_schedule.base_batch_size=64"]
    in_process([*QUICK, *ONE_STEP, *counted, *scaled, f"hydra.run.dir={tmp_path}"])
    assert len(constructed) == 1 and CountingClassifier.calls == 1
    plan = read_json(tmp_path / "plan.json")  # completed when fit started
    assert plan["base_lrs"] == {"SGD/decay": 0.05, "SGD/no_decay": 0.05}
    assert plan["base_lr"] == 0.05 and plan["lr"] == 0.1
    assert "learning rate: 0.05 @ 64 -> 0.1 @ 128 (linear)" in (tmp_path / "train.log").read_text()

    constructed.clear()
    CountingClassifier.calls = 0
    planned = in_process([*counted, *scaled, "dry_run=true", f"hydra.run.dir={tmp_path / 'dry'}"])
    assert len(constructed) == 1 and CountingClassifier.calls == 1
    assert planned["base_lrs"] == plan["base_lrs"] and planned["lr"] == 0.1


def test_a_run_refuses_a_returned_scheduler_before_its_first_step(tmp_path):
    """Where a run reads the LRs, when fit starts: the same one line as a dry run's, and no checkpoint written."""
    with pytest.raises(UserError) as refused:
        in_process([*QUICK, *ONE_STEP, "model._target_=user_modules.SchedulerClassifier", f"hydra.run.dir={tmp_path}"])
    assert str(refused.value) == SCHEDULER_REFUSED
    assert not (tmp_path / "checkpoints").exists()


def test_base_lrs_reads_every_return_format_and_names_groups_like_the_lr_monitor():
    net = DigitsCNN(width=4)
    sgd = torch.optim.SGD(
        [{"params": net[0].parameters(), "lr": 0.5, "name": "stem"}, {"params": net[-1].parameters()}], lr=0.1
    )
    adam = torch.optim.Adam(net[3].parameters(), lr=1e-3)

    class Module(torch.nn.Module):
        def __init__(self, returned):
            super().__init__()
            self.configure_optimizers = lambda: returned

    probe = probe_trainer({})
    assert base_lrs(Module(sgd), probe) == {"SGD/stem": 0.5, "SGD/pg2": 0.1}
    assert base_lrs(Module([sgd, adam]), probe) == {"SGD/stem": 0.5, "SGD/pg2": 0.1, "Adam/pg1": 1e-3}
    assert base_lrs(Module(None), probe) == {}
    assert base_lrs(Module({"optimizer": adam}), probe) == {"Adam/pg1": 1e-3}
    assert base_lrs(Module([{"optimizer": sgd}, {"optimizer": adam}]), probe) == base_lrs(Module([sgd, adam]), probe)
    step = torch.optim.lr_scheduler.StepLR(adam, 1)
    for returned in (([adam], [step]), {"optimizer": adam, "lr_scheduler": {"scheduler": step, "interval": "step"}}):
        with pytest.raises(
            UserError, match=r"Module.configure_optimizers returns a learning-rate scheduler \(StepLR\)"
        ):
            base_lrs(Module(returned), probe)
