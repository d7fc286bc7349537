"""Nothing on disk is stranded by a new engine version: a checkpoint written by the template before the engine
became its own distribution (0.2.0, fixtures/v0.2.0/last.ckpt: the digits CNN at width 8, float64, 3 steps, written
by `python train.py` of that version) evaluates, exports, starts a run (init.weights) and resumes with today's engine
(docs/checkpoints.md#across-versions: a resume across releases before 1.0 may be refused)."""

import json
import shutil

import pytest
import torch

from conftest import QUICK, TESTS, in_process, read_json
from scaleup.checkpoints.io import load_checkpoint
from scaleup.checkpoints.weights_file import open_weights
from scaleup.errors import UserError

OLD = TESTS / "fixtures" / "v0.2.0" / "last.ckpt"
# The overrides the old run trained with: a resume continues the same recipe.
RECIPE = [
    *QUICK,
    "model.net.width=8",
    "trainer.precision=64-true",
    "trainer.limit_train_batches=3",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
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

    weights = open_weights(str(OLD))  # init.weights=<the old checkpoint>: what a new run's network loads
    assert weights.shapes.keys() == old["state_dict"].keys() and weights.bn_batch_size == 64
    assert all(torch.equal(weights.read(name), tensor) for name, tensor in old["state_dict"].items())

    run_dir = tmp_path / "resumed"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copy(OLD, run_dir / "checkpoints" / "last.ckpt")
    in_process([*RECIPE, "trainer.max_epochs=2", "ckpt_path=last", f"hydra.run.dir={run_dir}"])
    assert load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 6


@pytest.mark.slow  # end-to-end runs
def test_a_checkpoint_of_a_renamed_package_evaluates_without_a_key_naming_the_package(tmp_path):
    """A checkpoint names your package as it was called when it trained (here `oldpkg`, the suite's `testbed` before
    a rename). eval.py finds each stored target that no longer imports in your package as your configs name it
    (the model and data `_target_`s of configs/train.yaml), with no config key naming it; a target found nowhere is
    one line naming both places it looked."""
    short = [*QUICK, "model.net.width=8", "trainer.max_epochs=1", "trainer.limit_train_batches=3"]
    metrics = in_process([*short, "trainer.limit_val_batches=1", f"hydra.run.dir={tmp_path / 'run'}"])
    (best,) = (tmp_path / "run" / "checkpoints").glob("best-*.ckpt")
    checkpoint = load_checkpoint(best)
    stored = json.dumps(checkpoint["scaleup"]["config"])
    assert '"testbed.models.DigitsCNN"' in stored and "package" not in checkpoint["scaleup"]["config"]
    checkpoint["scaleup"]["config"] = json.loads(stored.replace('"testbed.', '"oldpkg.'))
    torch.save(checkpoint, tmp_path / "renamed.ckpt")
    evaluated = in_process([f"ckpt_path={tmp_path / 'renamed.ckpt'}", f"hydra.run.dir={tmp_path / 'eval'}"], job="eval")
    assert (evaluated["test/acc"], evaluated["test/samples"]) == (metrics["test/acc"], 360)

    checkpoint["scaleup"]["config"]["model"]["net"]["_target_"] = "oldpkg.gone.DigitsCNN"
    torch.save(checkpoint, tmp_path / "moved.ckpt")
    with pytest.raises(UserError) as refused:
        in_process([f"ckpt_path={tmp_path / 'moved.ckpt'}", f"hydra.run.dir={tmp_path / 'refused'}"], job="eval")
    assert str(refused.value) == (
        f"{tmp_path / 'moved.ckpt'} was trained with model.net._target_=oldpkg.gone.DigitsCNN, which does not import "
        "(No module named 'oldpkg'), nor does testbed.gone.DigitsCNN in your package: make the class importable "
        "under one of these names"
    )
