"""One command on any device count: a per-device cap (a number or auto) derives the accumulation, and a run
pre-empted on 2 processes resumes mid-epoch on 1, and one pre-empted on 1 resumes on 2, all ending with the
2-process run's float64 weights.

The reference is the recipe as written for 2 devices: the shared 2-process float64 baseline (conftest.baseline),
2 processes x 32 samples, where the baseline's cap of 32 does not bite. On one device the same recipe with the
cap accumulates 2 micro-batches of 32 per step: the same micro-batches, so the same dropout masks.
"""

import copy
import shutil
import signal
import warnings

import lightning as L
import pytest
import torch
from torchmetrics import MeanMetric

from conftest import (
    EXACT,
    EXACT_EPOCHS,
    EXACT_STEPS_PER_EPOCH,
    TOLERANCE,
    assert_same_weights,
    batches,
    check,
    engine_section,
    in_process,
    performance,
    read_json,
    run,
    training_epochs,
    weights,
)
from probes import limited
from scaleup.build import build_model
from scaleup.callbacks.loop_repairs import rescale_batch_progress
from scaleup.checkpoints.io import load_checkpoint
from scaleup.errors import UserError
from scaleup.plan.batch_probe import (
    AUTO_MARGIN,
    AutoBatchSize,
    largest_that_fits,
    per_device_candidates,
    training_loss,
)
from scaleup.plan.resolve import build_plan
from scaleup.plan.topology import Topology

STEPS = EXACT_EPOCHS * EXACT_STEPS_PER_EPOCH


def test_candidates_are_the_exact_splits_largest_first():
    assert per_device_candidates(256, 8) == [32, 16, 8, 4, 2, 1]
    assert per_device_candidates(96, 2) == [48, 24, 16, 12, 8, 6, 4, 3, 2, 1]


def test_the_first_candidate_that_fits_wins_and_nothing_smaller_is_tried():
    tried = []
    assert largest_that_fits([32, 16, 8, 4], lambda size: tried.append(size) or size <= 10) == 8
    assert tried == [32, 16, 8]
    assert largest_that_fits([2, 1], lambda size: False) == 0


def test_the_probe_finds_the_limit_and_leaves_no_trace():
    """A real forward and backward of a BatchNorm + dropout network per candidate, on a device that runs out of
    memory above 24 samples: the model's weights, BatchNorm statistics, gradients and random stream are as
    before."""
    net = {"_target_": "testbed.models.DigitsCNN", "num_classes": 10, "norm": "batch", "dropout": 0.5}
    model = build_model(
        {"_target_": "testbed.models.ImageClassifier", "net": net, "optimizer": {"_target_": "torch.optim.SGD"}},
        precision="64-true",
    )
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="64-true", logger=False, enable_progress_bar=False)
    model.trainer = trainer  # as in fit, where the probe runs
    plan = build_plan(
        topology=Topology("cpu", 1, 1),
        trainer=engine_section("trainer/default", max_epochs=1),
        batches=batches(**{"global_batch_size": 64, "max_per_device_batch_size": "auto"}),
        lr_schedule=engine_section("lr_schedule/linear"),
        performance=performance(),
        base_lrs={"SGD": 0.1},
        seed=0,
        dataset_sizes={"train": 64},
        has_batchnorm=True,
        strategy="auto",
    )
    probe = AutoBatchSize(plan)
    probe.forward = limited(training_loss, 24)
    sample = (torch.randn(1, 8, 8), 3)
    state, rng = copy.deepcopy(model.state_dict()), torch.get_rng_state()
    fitting = [size for size in per_device_candidates(64, 1) if probe._fits(trainer, model, sample, size)]
    assert fitting == [16, 8, 4, 2, 1]
    assert_same_weights(model.state_dict(), state, rtol=0, atol=0)  # BatchNorm running statistics included
    assert all(p.grad is None for p in model.parameters()) and torch.equal(torch.get_rng_state(), rng)
    assert all(m.training for m in model.modules())


class Logs(L.LightningModule):
    """A training step that logs, as most do: a value, a dict and a Metric; with `reads_trainer`, it also asks
    its Trainer for the world size."""

    def __init__(self, reads_trainer: bool = False) -> None:
        super().__init__()
        self.layer, self.mean, self.reads_trainer = torch.nn.Linear(2, 1), MeanMetric(), reads_trainer

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch).pow(2).mean() * (self.trainer.world_size if self.reads_trainer else 1)
        self.mean.update(loss)
        self.log("train/loss", loss)
        self.log("train/mean", self.mean)
        self.log_dict({"train/other": loss})
        self.shadowed = {"log", "log_dict"} & set(vars(self))  # instance attributes in front of the methods
        return loss


def test_the_probes_training_step_logs_nothing_and_keeps_the_modules_own_methods():
    """The probe runs the step without its Trainer, where Lightning's `log` returns without logging (no warning
    shown, nothing shadowed on the module, the Trainer attached again after it); a step that reads self.trainer
    is refused in one line that names the setting."""
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    module = Logs()
    module.trainer = trainer
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = training_loss(module, torch.ones(3, 2))
    assert loss.shape == () and module.trainer is trainer and module.shadowed == set()
    assert trainer.callback_metrics == {} and trainer.logged_metrics == {}
    module = Logs(reads_trainer=True)
    module.trainer = trainer
    with pytest.raises(UserError, match=r"^data.max_per_device_batch_size=auto runs Logs.training_step without"):
        training_loss(module, torch.ones(3, 2))
    assert module.trainer is trainer


def progress(ready, started, processed, completed):
    counts = {"ready": ready, "started": started, "processed": processed, "completed": completed}
    return {"current": dict(counts), "total": {k: v + 80 for k, v in counts.items()}}


def checkpoint_with(accumulation, batch_progress):
    return {
        "scaleup": {"plan": {"accumulate_grad_batches": accumulation}},
        "loops": {"fit_loop": {"epoch_loop.batch_progress": batch_progress}},
    }


@pytest.mark.parametrize(
    ("before", "accumulation", "new_accumulation", "after"),
    [
        # saved in on_train_batch_end after step 5 of an epoch (not yet counted completed): 5 x 1 -> 5 x 2 batches
        (progress(5, 5, 5, 4), 1, 2, progress(10, 10, 10, 9)),
        (progress(12, 12, 12, 11), 4, 2, progress(6, 6, 6, 5)),
        # SIGTERM after 2 of step 6's 4 micro-batches: back to the end of step 5, in either accumulation
        (progress(22, 22, 22, 22), 4, 2, progress(10, 10, 10, 10)),
        (progress(22, 22, 22, 22), 4, 4, progress(20, 20, 20, 20)),
        # the end of an epoch of 8 steps
        (progress(8, 8, 8, 8), 1, 2, progress(16, 16, 16, 16)),
    ],
)
def test_batch_counters_are_restated_in_the_new_micro_batches(before, accumulation, new_accumulation, after):
    checkpoint = checkpoint_with(accumulation, before)
    rescale_batch_progress(checkpoint, new_accumulation)
    assert checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"] == after


@pytest.fixture(scope="module")
def reference(baseline):
    """2 processes x 32 (accumulation 1), with a checkpoint at step 13: epoch 1, 5 of its 8 steps done."""
    return baseline("two")


def final_weights(run_dir):
    return weights(run_dir / "checkpoints/last.ckpt")


def assert_equals_reference(reference, run_dir):
    assert load_checkpoint(run_dir / "checkpoints/last.ckpt")["global_step"] == STEPS
    worst = assert_same_weights(final_weights(reference), final_weights(run_dir), rtol=0, atol=TOLERANCE)
    print(f"{run_dir.name}: largest weight difference to 2 processes x 32: {worst:.1e}")


@pytest.mark.slow
def test_cap_runs_the_two_device_recipe_on_one_device(baseline, reference):
    """The 1-process baseline is the recipe with the cap on one device."""
    one = baseline("one")
    plan, reference_plan = read_json(one / "plan.json"), read_json(reference / "plan.json")
    assert (reference_plan["per_device_batch_size"], reference_plan["accumulate_grad_batches"]) == (32, 1)
    assert (plan["per_device_batch_size"], plan["accumulate_grad_batches"], plan["global_batch_size"]) == (32, 2, 64)
    assert plan["max_per_device_batch_size"] == reference_plan["max_per_device_batch_size"] == 32
    assert_equals_reference(reference, one)


@pytest.mark.slow
def test_two_process_mid_epoch_checkpoint_resumes_on_one_device(reference, tmp_path):
    mid_epoch = tmp_path / "step13.ckpt"
    shutil.copy(reference / "steps/at-13.ckpt", mid_epoch)
    in_process([*EXACT, "trainer.devices=1", f"ckpt_path={mid_epoch}", f"hydra.run.dir={tmp_path}"])
    log = (tmp_path / "train.log").read_text()
    assert "world_size 2 -> 1" in log and "accumulate_grad_batches 1 -> 2" in log
    assert_equals_reference(reference, tmp_path)
    # Epoch 1's sums of both ranks merged on the one: its figures are the 2-process run's.
    resumed, uninterrupted = training_epochs(tmp_path), training_epochs(reference)
    for tag, values in resumed.items():
        assert values == pytest.approx({15: uninterrupted[tag][15], 23: uninterrupted[tag][23]}, rel=1e-12), tag


@pytest.mark.slow
def test_auto_takes_the_largest_batch_every_device_fits(reference, tmp_path):
    """Rank 0 fits 32, rank 1 only 10 (simulated out-of-memory above): both settle on 8, the largest exact split
    of 32 that rank 1 holds, and accumulate 4 micro-batches per step. Micro-batches of 8 draw other dropout masks
    than micro-batches of 32 (a mask is drawn per micro-batch tensor), so the weights are not the reference's:
    the run trains its full schedule with the settled split."""
    check(
        run(
            [
                *EXACT,
                "data.max_per_device_batch_size=auto",
                "trainer.devices=2",
                "+callbacks.limit._target_=probes.SimulatedMemoryLimit",
                "+callbacks.limit.max_batch=[32,10]",
                f"hydra.run.dir={tmp_path}",
            ]
        )
    )
    log = (tmp_path / "train.log").read_text()
    assert "32 per device fits here, 8 on every device -> per-device batch 8, accumulation 4" in log
    plan = read_json(tmp_path / "plan.json")  # the plan made before the probe: it says auto
    assert (plan["world_size"], plan["max_per_device_batch_size"], plan["global_batch_size"]) == (2, "auto", 64)
    settled = read_json(tmp_path / "batch_probe.json")  # the probe's own record, written once
    assert settled == {"per_device_batch_size": 8, "accumulate_grad_batches": 4, "fits_on_rank_zero": 32}
    last = load_checkpoint(tmp_path / "checkpoints/last.ckpt")
    assert (last["scaleup"]["plan"]["per_device_batch_size"], last["scaleup"]["plan"]["accumulate_grad_batches"]) == (
        8,
        4,
    )
    assert last["global_step"] == STEPS


@pytest.mark.slow
def test_sigterm_between_micro_batches_resumes_with_another_accumulation(reference, tmp_path):
    """Pre-empted on 1 device with 1 of a step's 2 micro-batches done, resumed on 2 processes (accumulation 2 ->
    1): the checkpoint holds no partial gradients, so the resumed run replays that step whole, and its ranks draw
    the dropout masks the 1-device run drew for the same micro-batches."""
    stopped = run(
        [
            *EXACT,
            "trainer.devices=1",
            "+callbacks.sigterm._target_=probes.SigtermAtBatch",
            "+callbacks.sigterm.epoch=1",
            "+callbacks.sigterm.batch_idx=10",  # micro-batch 10 of epoch 1: the first of its step 5
            f"hydra.run.dir={tmp_path}",
        ]
    )
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert load_checkpoint(tmp_path / "checkpoints/last.ckpt")["global_step"] == 8 + 5
    check(run([*EXACT, "trainer.devices=2", "ckpt_path=last", f"hydra.run.dir={tmp_path}"]))
    log = (tmp_path / "train.log").read_text()
    assert "world_size 1 -> 2" in log and "accumulate_grad_batches 2 -> 1" in log
    assert read_json(tmp_path / "plan.json")["world_size"] == 2
    assert_equals_reference(reference, tmp_path)
    # The checkpoint carries epoch 1's sums as of step 13 (without the micro-batch the resume replays): epochs 1 and
    # 2's figures are the 2-process run's (512 samples, not 544). (Lightning logs them at steps 16 and 24 here.)
    resumed, uninterrupted = training_epochs(tmp_path), training_epochs(reference)
    for tag, values in resumed.items():
        epochs_1_and_2 = [value for _, value in sorted(values.items())][-2:]
        assert epochs_1_and_2 == pytest.approx([uninterrupted[tag][15], uninterrupted[tag][23]], rel=1e-10), tag
    assert resumed["samples"][16] == 512


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_on_a_gpu_splits_what_does_not_fit_and_keeps_its_margin(tmp_path):
    """ResNet-50 at 224 px in bf16-mixed with a global batch of 8192, more than one GPU holds: the probe splits it,
    and two real training steps at the settled batch (optimizer state included) stay within the probe's budget."""
    metrics = in_process(
        [
            "experiment=goyal_imagenet",
            "data.max_per_device_batch_size=auto",
            "data.train_size=16384",
            "data.val_size=64",
            "data.test_size=64",
            "trainer.max_steps=2",
            "trainer.num_sanity_val_steps=0",
            "trainer.enable_progress_bar=false",
            "logger=none",
            f"hydra.run.dir={tmp_path}",
        ]
    )
    plan = read_json(tmp_path / "plan.json")
    per_device, accumulation = plan["per_device_batch_size"], plan["accumulate_grad_batches"]
    assert accumulation > 1 and per_device * accumulation == 8192
    total_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
    print(
        f"auto: {per_device} per device x {accumulation}; peak {metrics['perf/peak_mem_gb']:.1f} of {total_gb:.0f} GiB"
    )
    assert metrics["perf/peak_mem_gb"] <= (1 - AUTO_MARGIN) * total_gb
