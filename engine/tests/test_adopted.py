"""Any LightningDataModule and LightningModule, as their authors wrote them: lightning-hydra-template's MNIST pair
(testbed/lht_mnist.py, unchanged but for docstrings) trains, evaluates and exports through the template's entry
points with its guarantees, on generated MNIST files."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import yaml

from conftest import QUICK, TOLERANCE, assert_same_weights, check, in_process, read_json, run, weights
from scaleup.build import check_model_fits_data
from scaleup.errors import UserError

PAIR = ["data=lht_mnist", "model=lht_mnist", *QUICK]
# 400 training samples in global batches of 64: 6 steps per epoch; val 100 -> 50/50 on 2 ranks, test 100.
STEPS_PER_EPOCH = 6


def write_mnist(root, n_train: int = 500, n_test: int = 100) -> None:
    """MNIST's four raw files as torchvision reads them (idx format): noise with a bright bar whose row is the class."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        images = rng.integers(0, 60, (n, 28, 28), dtype=np.uint8)
        for image, label in zip(images, labels, strict=True):
            image[2 * label + 4 : 2 * label + 7, 4:24] = 255
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, n, 28, 28) + images.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, n) + labels.tobytes())


@pytest.fixture(scope="module")
def mnist(tmp_path_factory) -> list[str]:
    """The pair's overrides, reading generated MNIST files."""
    root = tmp_path_factory.mktemp("mnist")
    write_mnist(root)
    return [*PAIR, f"paths.data_dir={root}"]


def test_the_train_loaders_batch_size_is_the_global_batch_unless_the_config_sets_one(mnist, tmp_path):
    plan = in_process([*mnist, "dry_run=true", "trainer.devices=2", f"hydra.run.dir={tmp_path}"])
    assert (plan["global_batch_size"], plan["per_device_batch_size"], plan["steps_per_epoch"]) == (64, 32, 6)
    plan = in_process([*mnist, "dry_run=true", "data.global_batch_size=128", f"hydra.run.dir={tmp_path / 'set'}"])
    assert (plan["global_batch_size"], plan["per_device_batch_size"], plan["steps_per_epoch"]) == (128, 128, 3)
    assert (
        "the plan's per-device batch replaces the batch_size=64 of MNISTDataModule's own loaders"
        in (tmp_path / "set" / "train.log").read_text()
    )


def test_what_the_data_module_knows_fills_the_nets_null_keys_and_every_missing_one_is_named(mnist, tmp_path):
    """The pair's DataModule has a `num_classes` property: a net that waits for it (`null`) gets it, as from the
    template's own modules' `model_settings()`; what no one gives is named, every key at once."""
    cnn = [*mnist, "model=digits_cnn", "dry_run=true"]
    with pytest.raises(UserError) as raised:
        in_process([*cnn, f"hydra.run.dir={tmp_path / 'missing'}"])
    assert str(raised.value) == (
        "model.net.in_channels is null, to be taken from the data, and the data (testbed.lht_mnist.MNISTDataModule) "
        "does not give it (it gives model.net.num_classes): set model.net.in_channels=<value>"
    )
    in_process([*cnn, "model.net.in_channels=1", f"hydra.run.dir={tmp_path / 'run'}"])
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]["net"]["num_classes"] == 10
    net = {"_target_": "testbed.models.DigitsCNN", "num_classes": None, "in_channels": None}
    with pytest.raises(UserError) as raised:
        check_model_fits_data({"_target_": "m", "net": net}, {"_target_": "d"}, {})
    assert str(raised.value) == (
        "model.net.num_classes, model.net.in_channels are null, to be taken from the data, and the data (d) does not "
        "give them: set model.net.num_classes=<value> model.net.in_channels=<value>"
    )


def test_a_returned_scheduler_names_the_setting_that_replaces_it(mnist, tmp_path):
    scheduler = "model.scheduler={_target_:torch.optim.lr_scheduler.StepLR,_partial_:true,step_size:1}"
    with pytest.raises(UserError, match=r"MNISTLitModule.configure_optimizers returns a learning-rate scheduler"):
        in_process([*mnist, "dry_run=true", scheduler, f"hydra.run.dir={tmp_path}"])


@pytest.mark.slow
def test_the_lightning_hydra_template_pair_trains_evaluates_and_exports_the_same_on_1_and_2_processes(mnist, tmp_path):
    """1 process accumulating 2 micro-batches of 32 and 2 processes of 32 each: BatchNorm normalises the same
    samples, so the float64 parameters agree. Its running statistics do not: each rank keeps its own and DDP
    broadcasts rank 0's (SyncBatchNorm, which would gather them, needs GPUs). A checkpoint evaluates to the same
    accuracy on 2 processes and on 1: every test sample counted once."""
    exact = [*mnist, "trainer.precision=64-true", "data.max_per_device_batch_size=32"]
    in_process([*exact, f"hydra.run.dir={tmp_path / 'one'}"])
    check(run([*exact, "trainer.devices=2", f"hydra.run.dir={tmp_path / 'two'}"]))
    one, two = (weights(tmp_path / run_dir / "checkpoints/last.ckpt") for run_dir in ("one", "two"))
    buffers = [name for name in one if "running_" in name or "num_batches_tracked" in name]
    assert len(buffers) == 9  # 3 BatchNorm layers
    for name in buffers:
        del one[name], two[name]
    assert_same_weights(one, two, 0, TOLERANCE)
    assert torch.load(tmp_path / "two/checkpoints/last.ckpt", weights_only=True)["global_step"] == 2 * STEPS_PER_EPOCH
    (best,) = (tmp_path / "two" / "checkpoints").glob("best-*.ckpt")
    evaluated = in_process([f"ckpt_path={best}", f"hydra.run.dir={tmp_path / 'eval'}"], job="eval")
    assert evaluated["test/acc"] == read_json(tmp_path / "two" / "metrics.json")["test/acc"]
    in_process([f"ckpt_path={best}", f"output_path={tmp_path / 'net.pt'}"], job="export")
    from testbed.lht_mnist import SimpleDenseNet

    net = SimpleDenseNet(784, 16, 32, 16, 10).double()
    net.load_state_dict(torch.load(tmp_path / "net.pt", weights_only=True), strict=True)
