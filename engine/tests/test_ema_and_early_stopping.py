"""EMA and EarlyStopping as configs (`callbacks=[default,early_stopping,ema]`): the averaged weights are what
validation, testing, eval.py and export.py see, and both survive a mid-epoch resume exactly (float64)."""

import shutil

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch.utils.data import default_collate

from conftest import EXACT, TOLERANCE, assert_same_weights, in_process, read_json
from scaleup.build import build_model
from scaleup.callbacks.ema import EMA
from scaleup.checkpoints.io import load_checkpoint, load_weights
from scaleup.errors import UserError
from scaleup.trainer import on_training_device

pytestmark = pytest.mark.slow

# BatchNorm on, so the average covers buffers too. min_delta=10 on val/acc: only the first validation counts as
# an improvement, so with patience 2 the run stops after epoch 2, at step 24 of the 48 planned.
ARGS = [
    *EXACT,
    "model.net.norm=batch",
    "trainer.max_epochs=6",
    "callbacks=[default,early_stopping,ema]",
    "callbacks.early_stopping.patience=2",
    "callbacks.early_stopping.min_delta=10",
    "callbacks.ema.decay=0.9",
]
STOPPED_AT = 24


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run as planned, leaving a checkpoint at step 13 (epoch 1, 5 of 8 steps done) on the way."""
    run_dir = tmp_path_factory.mktemp("ema")
    in_process(
        [
            *ARGS,
            "+callbacks.at_step._target_=lightning.pytorch.callbacks.ModelCheckpoint",
            f"+callbacks.at_step.dirpath={run_dir / 'steps'}",
            "+callbacks.at_step.every_n_train_steps=13",
            "+callbacks.at_step.save_top_k=-1",
            "+callbacks.at_step.filename=step13",
            f"hydra.run.dir={run_dir}",
        ]
    )
    return run_dir


@pytest.mark.parametrize(("accelerator", "device"), [("cpu", "cpu"), ("gpu", "cuda")])
def test_the_ema_is_given_the_training_devices_type(accelerator, device):
    """Each EMA entry (the engine's, Lightning's, a subclass) is built with the training device's type as `device`
    (on a GPU: each rank's own, which Lightning sets before callbacks' setup); given none, Lightning builds the
    average where the model is in setup, on the CPU (canary:
    test_ema_average_is_built_before_the_model_moves_to_its_device). A device the config names is kept; other
    callbacks get none. On a GPU: test_gpu.py::test_ema_averages_on_the_gpu."""
    ema = {"_target_": "scaleup.callbacks.ema.EMA", "decay": 0.9}
    group = {
        "ema": ema,
        "subclass": {"_target_": f"{__name__}.OwnEMA"},
        "lightnings": {"_target_": "lightning.pytorch.callbacks.EMAWeightAveraging"},
        "named": {**ema, "device": "cpu"},
        "other": {"_target_": "lightning.pytorch.callbacks.EarlyStopping", "monitor": "val/loss"},
    }
    given = on_training_device(group, accelerator)
    assert {name: entry.get("device") for name, entry in given.items()} == {
        "ema": device,
        "subclass": device,
        "lightnings": device,
        "named": "cpu",
        "other": None,
    }
    assert group["ema"] == {"_target_": "scaleup.callbacks.ema.EMA", "decay": 0.9}  # the stored config unchanged


class OwnEMA(EMA):
    """A project's own EMA."""


def early_stopping_state(checkpoint):
    return next(state for name, state in checkpoint["callbacks"].items() if name.startswith("EarlyStopping"))


def test_early_stopping_ends_the_run_and_says_so(uninterrupted):
    checkpoint = load_checkpoint(uninterrupted / "checkpoints/last.ckpt")
    assert checkpoint["global_step"] == STOPPED_AT
    assert early_stopping_state(checkpoint)["wait_count"] == 2
    plan = read_json(uninterrupted / "plan.json")
    early_stopping = (plan["early_stopping_monitor"], plan["early_stopping_mode"], plan["early_stopping_patience"])
    assert (early_stopping, plan["total_steps"]) == (("val/acc", "max", 2), 48)
    log = (uninterrupted / "train.log").read_text()
    assert f"early stopping ended the run at step {STOPPED_AT} of the 48 planned (epoch 2)" in log


def test_resume_with_ema_and_early_stopping_equals_the_uninterrupted_run(uninterrupted, tmp_path):
    """Without the restored EarlyStopping state the resumed run would count epoch 1 as an improvement and stop
    at step 32; without the restored average its EMA would restart from the step-13 weights."""
    mid_epoch = tmp_path / "step13.ckpt"
    shutil.copy(uninterrupted / "steps/step13.ckpt", mid_epoch)
    in_process([*ARGS, f"ckpt_path={mid_epoch}", f"hydra.run.dir={tmp_path}"])
    straight = load_checkpoint(uninterrupted / "checkpoints/last.ckpt")
    resumed = load_checkpoint(tmp_path / "checkpoints/last.ckpt")
    assert resumed["global_step"] == STOPPED_AT
    assert early_stopping_state(resumed) == early_stopping_state(straight)
    for key in ("state_dict", "current_model_state"):  # the average, and the weights training continues from
        worst = assert_same_weights(straight[key], resumed[key], rtol=0, atol=TOLERANCE)
        print(f"{key}: resumed vs uninterrupted, largest difference {worst:.1e}")
    ema, current = straight["state_dict"]["net.0.weight"], straight["current_model_state"]["net.0.weight"]
    assert (ema - current).abs().max() > 1e-3  # two different sets of weights


def test_a_run_that_stopped_early_refuses_to_resume(uninterrupted, tmp_path):
    shutil.copy(uninterrupted / "checkpoints/last.ckpt", tmp_path / "stopped.ckpt")
    with pytest.raises(UserError, match=r"early stopping ended at epoch 2 .*nothing to resume"):
        in_process([*ARGS, f"ckpt_path={tmp_path / 'stopped.ckpt'}", f"hydra.run.dir={tmp_path}"])


def test_validation_test_eval_and_export_use_the_average(uninterrupted, tmp_path):
    checkpoint = load_checkpoint(uninterrupted / "checkpoints/last.ckpt")
    config, metrics = checkpoint["scaleup"]["config"], read_json(uninterrupted / "metrics.json")

    # Validation: the last epoch's val/loss is the averaged weights' loss (last.ckpt is written after it).
    model = build_model(config["model"], precision="64-true")
    load_weights(model, checkpoint["state_dict"])
    datamodule = instantiate(config["data"])
    datamodule.setup()
    images, labels = default_collate(list(datamodule.splits["val"]))
    with torch.no_grad():
        val_loss = F.cross_entropy(model.eval()(images.double()), labels).item()
    assert val_loss == pytest.approx(metrics["val/loss"], rel=1e-12)

    # Test: train.py's final test, and eval.py on the same checkpoint, score the averaged weights alike.
    best = next((uninterrupted / "checkpoints").glob("best-*.ckpt"))
    evaluated = in_process([f"ckpt_path={best}", f"hydra.run.dir={tmp_path / 'eval'}"], job="eval")
    assert evaluated["test/loss"] == metrics["test/loss"] and evaluated["test/acc"] == metrics["test/acc"]

    # Export: the network's averaged weights.
    exported = tmp_path / "net.pt"
    in_process([f"ckpt_path={best}", f"output_path={exported}", f"hydra.run.dir={tmp_path / 'export'}"], job="export")
    averaged = {k.removeprefix("net."): v for k, v in load_checkpoint(best)["state_dict"].items()}
    assert_same_weights(torch.load(exported, weights_only=True), averaged, rtol=0, atol=0)


def test_a_requeued_run_that_stopped_early_runs_its_test(uninterrupted, tmp_path):
    """`ckpt_path=last` on a run that early stopping ended (say it was pre-empted during its final test): there
    is nothing to train, so it tests the best checkpoint and completes."""
    shutil.copytree(uninterrupted, tmp_path / "run")
    (tmp_path / "run" / "metrics.json").unlink()
    metrics = in_process([*ARGS, "ckpt_path=last", f"hydra.run.dir={tmp_path / 'run'}"])
    assert metrics["test/samples"] == read_json(uninterrupted / "metrics.json")["test/samples"]
