"""Nothing on disk is stranded by a new engine version: a checkpoint written by the template before the engine
became its own distribution (0.2.0, fixtures/v0.2.0/last.ckpt: the digits CNN at width 8, float64, 3 steps, written
by `python train.py` of that version) evaluates, exports and resumes with today's engine."""

import shutil

import pytest
import torch

from conftest import QUICK, TESTS, in_process, read_json
from scaleup.checkpoints.io import load_checkpoint

OLD = TESTS / "fixtures" / "v0.2.0" / "last.ckpt"
# The overrides the old run trained with: a resume continues the same recipe.
RECIPE = [
    *QUICK,
    "model.net.width=8",
    "trainer.precision=64-true",
    "+trainer.limit_train_batches=3",
    "+trainer.limit_val_batches=1",
    "+trainer.limit_test_batches=1",
]


@pytest.mark.slow  # end-to-end runs
def test_a_checkpoint_of_the_previous_layout_evaluates_exports_and_resumes(tmp_path):
    old = load_checkpoint(OLD)
    assert old["global_step"] == 3 and old["scaleup"]["config"]["package"] == "myproject"

    metrics = in_process([f"ckpt_path={OLD}", f"hydra.run.dir={tmp_path / 'eval'}"], job="eval")
    assert metrics["test/samples"] == 360  # eval's whole test split, from the stored data config
    assert read_json(tmp_path / "eval" / "metrics.json")["test/samples"] == 360

    exported = tmp_path / "net.pt"
    in_process([f"ckpt_path={OLD}", f"output_path={exported}"], job="export")
    net = torch.load(exported, weights_only=True)  # the network's state_dict, every weight of the checkpoint's
    stored = {k.removeprefix("net."): v for k, v in old["state_dict"].items() if k.startswith("net.")}
    assert net.keys() == stored.keys() and all(torch.equal(net[k], stored[k]) for k in net)

    run_dir = tmp_path / "resumed"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copy(OLD, run_dir / "checkpoints" / "last.ckpt")
    in_process([*RECIPE, "trainer.max_epochs=2", "ckpt_path=last", f"hydra.run.dir={run_dir}"])
    assert load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 6
