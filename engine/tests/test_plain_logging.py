"""A module written the way Lightning's README writes one (engine/tests/user_modules.py LitAutoEncoder: plain
`self.log("val_loss", loss)`, no sync_dist, no torchmetrics) trains, is summarised, evaluated and exported, and its
evaluation metrics are the same on 1 and 2 processes (ExactEvalMetrics), to rounding, in float64."""

import logging
import re

import pytest
import torch

from conftest import QUICK, check, in_process, read_json, run
from scaleup.observability.rows import log_rows
from user_modules import LitAutoEncoder

# 2 epochs of digits in float64; val 181 and test 359 samples split 91/90 and 180/179 over 2 ranks, in batches of
# 32 (the last one short): the batch-size weighting of the mean matters, and odd totals catch a sample count
# halved in integers.
LIT = [
    *QUICK,
    "model=lit_autoencoder",
    "monitor.metric=val_loss",
    "monitor.mode=min",
    "trainer.precision=64-true",
    "data.val_size=181",
    "data.test_size=359",
]
# Every other reduction (sum, max, min, a mean with an explicit batch size, a mean with sync_dist=True) and one
# value no reduction makes exact.
REDUCTIONS = ["+callbacks.reductions._target_=user_modules.ReductionLogger"]
REDUCED = ("samples", "max_sum", "min_sum", "mean_pixel", "synced_pixel")
EXACT_TO = 1e-12  # float64: the 2-process sums differ from the 1-process ones only in the order of additions


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lit") / "one"
    in_process([*LIT, *REDUCTIONS, f"hydra.run.dir={run_dir}"])
    (best,) = (run_dir / "checkpoints").glob("best-*.ckpt")
    return run_dir, best


@pytest.mark.slow  # an end-to-end run
def test_a_readme_module_trains_and_its_summary_shows_every_metric(one_process):
    run_dir, _ = one_process
    metrics = read_json(run_dir / "metrics.json")
    assert {"train_loss", "val_loss", "test_loss"} <= metrics.keys()
    summary = (run_dir / "train.log").read_text().split(f"done: {run_dir}", 1)[1]
    for name in ("train_loss", "val_loss", "test_loss"):
        assert re.search(rf"^  {name} +{metrics[name]:.4f}$", summary, re.M), name


@pytest.mark.slow  # an end-to-end run
def test_the_best_checkpoint_follows_the_configured_monitor(one_process):
    """monitor.metric=val_loss, monitor.mode=min: the best checkpoint is the epoch of the lowest val_loss, and the
    one the run tests."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, best = one_process
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    val_loss = [event.value for event in events.Scalars("val_loss")]
    lowest = min(range(len(val_loss)), key=val_loss.__getitem__)
    assert len(val_loss) == 2 and best.name == f"best-epoch{lowest:03d}-{val_loss[lowest]:.4f}.ckpt"
    assert "tested the best checkpoint by val_loss" in (run_dir / "train.log").read_text()


@pytest.mark.slow  # an end-to-end run
def test_a_readme_module_evaluates_and_exports(one_process, tmp_path):
    run_dir, best = one_process
    evaluated = in_process([f"ckpt_path={best}", f"hydra.run.dir={tmp_path / 'eval'}"], job="eval")
    assert evaluated["test_loss"] == read_json(run_dir / "metrics.json")["test_loss"]  # same batches, same bits
    out = tmp_path / "encoder.pt"
    in_process([f"ckpt_path={best}", f"output_path={out}", "module=encoder"], job="export")
    encoder = LitAutoEncoder().double().encoder
    encoder.load_state_dict(torch.load(out, weights_only=True))
    trained = torch.load(best, weights_only=True)["state_dict"]
    assert all(torch.equal(value, trained[f"encoder.{key}"]) for key, value in encoder.state_dict().items())


@pytest.mark.slow
def test_plain_self_log_val_and_test_loss_are_the_same_on_two_processes(one_process, tmp_path):
    run_dir, _ = one_process
    result = check(
        run([*LIT, *REDUCTIONS, "trainer.devices=2", "trainer.accelerator=cpu", f"hydra.run.dir={tmp_path}"])
    )
    one, two = read_json(run_dir / "metrics.json"), read_json(tmp_path / "metrics.json")
    for name in ("val_loss", "test_loss", *(f"{stage}_{name}" for stage in ("val", "test") for name in REDUCED)):
        assert two[name] == pytest.approx(one[name], rel=0, abs=EXACT_TO), name
    assert (two["val_samples"], two["test_samples"]) == (181, 359)
    # Logged at the epoch's end, after the reduction, different on each rank: named once, loudly, with what is
    # reported (with sync_dist=True, the average of rank 0 and 1: 0.5); the same on every rank: exact, not named.
    log = (tmp_path / "train.log").read_text()
    named = "val_rank (rank 0's value reported), val_synced_rank (the ranks' values averaged): logged with"
    assert log.count(f"NOT EXACT on 2 processes: {named}") == 1
    assert (two["val_rank"], two["val_synced_rank"], two["val_same"], two["val_synced_same"]) == (0, 0.5, 1, 1)
    # Nothing of torch's or Lightning's the user cannot act on, from either rank (observability/quiet.py); not
    # Lightning's advice to log val_rank with sync_dist=True beside the line above (an unweighted mean of the ranks).
    noise = ("LeafSpec", "all_gather is deprecated", "litlogger", "use sync_dist=True")
    printed = (result.stdout + result.stderr).splitlines()
    assert [line for line in printed if any(word in line for word in noise)] == []


@pytest.mark.slow
def test_eval_on_two_processes_gives_the_one_process_test_loss(one_process, tmp_path):
    run_dir, best = one_process
    check(
        run(
            [f"ckpt_path={best}", "trainer.devices=2", "trainer.accelerator=cpu", f"hydra.run.dir={tmp_path}"],
            script="eval.py",
        )
    )
    one = read_json(run_dir / "metrics.json")["test_loss"]
    assert read_json(tmp_path / "metrics.json")["test_loss"] == pytest.approx(one, rel=0, abs=EXACT_TO)


def test_log_rows_without_rows_logs_the_title(caplog):
    with caplog.at_level(logging.INFO, logger="scaleup"):
        log_rows("done: run", [])
    assert caplog.messages == ["done: run\n  (none)"]
