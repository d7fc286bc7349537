"""1 vs N devices on CPU with 2 real processes (gloo): same weights, exact metrics, random numbers by position,
LR plan.

The runs are the shared float64 baselines (conftest `baseline`): 3 epochs, 24 optimizer steps of AdamW, with
dropout 0.5 and random augmentation, on 1 process (accumulating 2 micro-batches of 32, from the cap), on 2
processes x 32 loading with 2 workers each, and on 1 process with accumulation 2 set by hand, all with the same
global batch of 64.
"""

import math
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import (
    EXACT_EPOCHS,
    EXACT_STEPS_PER_EPOCH,
    EXACT_TEST,
    EXACT_TRAIN,
    EXACT_VAL,
    EXACT_WARMUP_STEPS,
    LR_TAG,
    TOLERANCE,
    TOPOLOGIES,
    assert_same_weights,
    in_process,
    read_json,
    run_command,
    warmup_cosine,
    weights,
)
from scaleup.check_equivalence import GENERATORS, HELD, RUNS, last_checkpoint, run_arguments, verdict

pytestmark = pytest.mark.slow


def probe(baseline, name, rank=0):
    return read_json(baseline(name) / "probe" / f"rank{rank}.json")


@pytest.mark.parametrize("other", ["two", "accum"])
def test_one_device_equals_two_devices_and_accumulation(baseline, other):
    """In float64, to TOLERANCE (absolute) after 3 full epochs, with dropout and augmentation drawing their random
    numbers: the same ones for the same samples at the same step. In float32 the same runs agree only to
    rounding, and rounding differs between CPUs (measured 1e-7 on one machine, 1.4e-4 on another)."""
    one, two = weights(baseline("one") / "checkpoints/last.ckpt"), weights(baseline(other) / "checkpoints/last.ckpt")
    worst = assert_same_weights(one, two, rtol=0, atol=TOLERANCE)
    print(f"1 device vs {other}: largest weight difference {worst:.1e} after {EXACT_EPOCHS} epochs (float64)")


def test_plan_records_the_topology(baseline):
    plans = [read_json(baseline(name) / "plan.json") for name in TOPOLOGIES]
    assert [(plan["world_size"], plan["per_device_batch_size"]) for plan in plans] == [(1, 32), (2, 32), (1, 32)]
    assert [plan["accumulate_grad_batches"] for plan in plans] == [2, 1, 2]
    assert {plan["global_batch_size"] for plan in plans} == {64}
    assert {plan["precision"] for plan in plans} == {"64-true"}


def test_exact_evaluation_on_uneven_shards(baseline):
    one, two = read_json(baseline("one") / "metrics.json"), read_json(baseline("two") / "metrics.json")
    assert (two["val/samples"], two["test/samples"]) == (EXACT_VAL, EXACT_TEST)  # no padding, no sample twice
    for stage in ("val", "test"):
        assert two[f"{stage}/acc"] == one[f"{stage}/acc"]
        # The metric states sum in float64 in a 64-true run, in another order on 2 ranks.
        assert math.isclose(two[f"{stage}/loss"], one[f"{stage}/loss"], rel_tol=1e-12)


def test_sample_order_per_epoch(baseline):
    r0, r1 = probe(baseline, "two", 0), probe(baseline, "two", 1)
    steps = EXACT_STEPS_PER_EPOCH
    epochs = [str(epoch) for epoch in range(EXACT_EPOCHS)]
    for epoch in epochs:
        union = r0["epochs"][epoch] + r1["epochs"][epoch]
        # each sample once, all but the one sample that does not fill a global batch
        assert len(union) == len(set(union)) == steps * 64 == EXACT_TRAIN - 1
    assert r0["epochs"]["0"] != r0["epochs"]["1"]  # set_epoch reshuffles
    # The same global batches with accumulation and on 2 processes as on 1.
    one, accum = probe(baseline, "one"), probe(baseline, "accum")
    assert one["epochs"] == accum["epochs"]
    for epoch in epochs:
        for step in range(steps):
            half = slice(step * 32, (step + 1) * 32)
            two_step = sorted(r0["epochs"][epoch][half] + r1["epochs"][epoch][half])
            assert two_step == sorted(one["epochs"][epoch][step * 64 : (step + 1) * 64])


def test_per_rank_streams_and_identical_init(baseline):
    """Ranks draw different dropout masks and augmentations (they hold other samples), but micro-batch j of rank r
    draws what micro-batch r x 1 + j draws on 1 device accumulating 2: the same stream for the same global-batch
    offset at the same step, and the same augmented inputs, loaded by a worker or by the main process."""
    r0, r1 = probe(baseline, "two", 0), probe(baseline, "two", 1)
    assert [r["world_size"] for r in (r0, r1)] == [2, 2]
    assert r0["initial_checksum"] == r1["initial_checksum"] == probe(baseline, "one")["initial_checksum"]
    ranks = [r0["micro_batches"], r1["micro_batches"]]
    assert [[m["step"] for m in rank] for rank in ranks] == [[0, 1], [0, 1]]
    assert r0["micro_batches"][0]["draw"] != r1["micro_batches"][0]["draw"]
    assert r0["micro_batches"][0]["draw"] != r0["micro_batches"][1]["draw"]  # and per step
    interleaved = [ranks[rank][step] for step in range(2) for rank in range(2)]  # step 0: offsets 0, 32; step 1
    for name in ("one", "accum"):
        assert probe(baseline, name)["micro_batches"] == interleaved


def logged_lr(run_dir):
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(LR_TAG)}


def test_lr_curve_logged_per_step_matches_the_plan(baseline):
    """Read back from TensorBoard: warmup from the base LR 1e-3 to the peak 2e-3 (global batch 64 over the base
    32, linear rule) over 16 steps, then cosine to 0 at step 24, per optimizer step (test_resume checks that a
    resumed run logs the same curve)."""
    steps = EXACT_EPOCHS * EXACT_STEPS_PER_EPOCH
    for name in TOPOLOGIES:
        plan = read_json(baseline(name) / "plan.json")
        assert (plan["warmup_steps"], plan["total_steps"], plan["lr"]) == (EXACT_WARMUP_STEPS, steps, 2e-3)
        logged = logged_lr(baseline(name))
        assert sorted(logged) == list(range(steps))
        expected = {step: warmup_cosine(step, 1e-3, 2e-3, EXACT_WARMUP_STEPS, steps) for step in logged}
        assert logged == pytest.approx(expected, rel=1e-6)
        assert [logged[step] for step in (0, 8, 16, 20)] == pytest.approx([1e-3, 1.5e-3, 2e-3, 1e-3], rel=1e-6)


def test_ddp_checkpoint_evaluates_on_one_device(baseline, tmp_path):
    best = next((baseline("two") / "checkpoints").glob("best-*.ckpt"))
    one_device = in_process(
        [f"ckpt_path={best}", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}"], job="eval"
    )
    two_devices = read_json(baseline("two") / "metrics.json")
    assert one_device["test/samples"] == two_devices["test/samples"] == EXACT_TEST
    assert one_device["test/acc"] == two_devices["test/acc"]
    assert math.isclose(one_device["test/loss"], two_devices["test/loss"], rel_tol=1e-12)


def test_uneven_memory_across_ranks_is_reported(baseline):
    log = (baseline("two") / "train.log").read_text()
    warning = next(line for line in log.splitlines() if "peak memory differs" in line)
    rank0, rank1 = (float(part.split(" GB")[0].split()[-1]) for part in warning.split(", ")[:2])
    assert rank1 - rank0 > 0.5  # most of the 1 GiB held on rank 1 (peak RSS, in GB)


def test_equivalence_check_catches_a_global_count_loss():
    """The tool's own runs, in float64, on the seeds' pitfall: a loss divided by the global batch. Accumulating 2
    micro-batches on one process halves its gradient, as 2 processes would. On the default model (BatchNorm) with
    dropout, which the check holds (fixed statistics, no masks) so that they excuse nothing: they made it pass.
    Run as the README says, with `python -m`: the callbacks it hands its runs must be importable there (not
    `__main__.DrawnGenerators`)."""
    command = [sys.executable, "-m", "scaleup.check_equivalence", "model.net.dropout=0.5"]
    command.append("model._target_=probes.GlobalCountLoss")
    proc = run_command(command)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert out.startswith("comparing 2 CPU processes, 1 accumulating 2 micro-batches and 1 with the whole batch")
    assert "NOT EQUIVALENT in float64: splitting the batch into micro-batches changes the result" in out
    print(out)


# The template's model with the layers that compute over the micro-batch: BatchNorm (its default), dropout, both;
# and the layers the check holds (its dropout layer is there at p=0 too).
BATCHNORM = "net.1, net.4, net.8 (BatchNorm2d); net.12 (Dropout)"
MODELS = {
    "batchnorm": ([], BATCHNORM),
    "groupnorm+dropout": (["model.net.norm=group", "model.net.dropout=0.5"], "net.12 (Dropout)"),
    "batchnorm+dropout": (["model.net.dropout=0.5"], BATCHNORM),
}


def whole_and_split(directory, overrides):
    """The check's verdict on its whole-batch run and its run accumulating 2 micro-batches, both trained in this
    process with the check's own arguments and callbacks. The 2-process run (the one that costs) stands in as the
    latter: these tests are about the whole batch."""
    for name in ("1", "1x2"):
        in_process(run_arguments(*RUNS[name], ["trainer.precision=64-true", *overrides], directory / name))
    checkpoints = {name: last_checkpoint(directory / name) for name in ("1", "1x2")}
    drawn, held = read_json(directory / "1x2" / GENERATORS), read_json(directory / "1x2" / HELD)
    return verdict({**checkpoints, "2": checkpoints["1x2"]}, "64-true", drawn["own"], drawn["global"], held)


@pytest.mark.parametrize("model", MODELS)
def test_equivalence_check_holds_batchnorm_and_dropout(tmp_path, model):
    """With BatchNorm on its fixed statistics and dropout off, a whole batch and its micro-batches compute the same
    per sample: a mean over the device's batch agrees to rounding, a loss divided by the global count does not.
    (BatchNorm and dropout used to excuse any difference, the global count's included: EQUIVALENT, exit 0.)"""
    overrides, held = MODELS[model]
    code, lines = whole_and_split(tmp_path / "mean", overrides)
    assert code == 0, lines
    assert float(lines[1].split("difference ")[1].split()[0]) < 1e-12
    why = "BatchNorm on fixed statistics, dropout off: a whole batch and its micro-batches compute alike"
    assert lines[2] == f"held in all three runs ({why}): {held}"
    code, lines = whole_and_split(tmp_path / "global", [*overrides, "model._target_=probes.GlobalCountLoss"])
    assert code == 1 and float(lines[1].split("difference ")[1].split()[0]) > 0.1
    assert lines[-1].startswith("NOT EQUIVALENT in float64: splitting the batch into micro-batches changes the result")


def runs(one, split, two, optimizers=({}, {}, {})):
    """The three runs' checkpoints, from their state_dicts and optimizer states (`{param index: {name: tensor}}`)."""
    states = (one, split, two)
    return {
        name: {"state_dict": state, "optimizer_states": [{"state": optimizer}]}
        for name, state, optimizer in zip(("1", "1x2", "2"), states, optimizers, strict=True)
    }


def test_equivalence_verdict_in_float64_and_float32():
    one = {"w": torch.ones(3, dtype=torch.float64), "steps": torch.tensor(8)}
    close = {"w": one["w"] + 1e-13, "steps": torch.tensor(8)}
    off = {"w": one["w"] + 1e-6, "steps": torch.tensor(8)}
    code, lines = verdict(runs(one, close, one), "64-true")
    assert code == 0 and lines[-1].startswith("EQUIVALENT in float64")
    code, lines = verdict(runs(one, one, off), "64-true")
    assert code == 1 and lines[0] == (
        "2 processes vs 1 accumulating 2: largest relative difference 1.00e-06 (w), tolerance 1e-10"
    )
    assert lines[-1].startswith("NOT EQUIVALENT in float64: the same micro-batches give other weights or optimizer")
    code, lines = verdict(runs(one, off, off), "64-true")
    assert code == 1 and lines[-1].startswith("NOT EQUIVALENT in float64: splitting the batch into micro-batches")
    code, lines = verdict(runs(one, off, one), "32-true")  # within float32's rounding allowance
    assert code == 0 and lines[-1].startswith("EQUIVALENT in float32")


def test_equivalence_verdict_compares_optimizer_state():
    """The optimizer state must agree: a gradient scaled by a constant shows in Adam's moments even where Adam's
    update hides it from the weights."""
    w = {"net.1.weight": torch.ones(3, dtype=torch.float64)}
    moments = {0: {"exp_avg": w["net.1.weight"], "step": torch.tensor(8.0)}}
    halved = {0: {"exp_avg": w["net.1.weight"] / 2, "step": torch.tensor(8.0)}}
    code, lines = verdict(runs(w, w, w, (moments, halved, halved)), "64-true")
    assert code == 1 and lines[1] == (
        "1 process: whole batch vs 2 x half: largest relative difference 5.00e-01 "
        "(optimizer_states[0].state[0].exp_avg), tolerance 1e-10"
    )


def test_equivalence_verdict_names_the_randomness_behind_a_difference():
    """A generator of the user's own that training drew from is named when 2 processes differ from the same
    micro-batches on 1; the global generators that training steps still drew from (randomness the check cannot
    hold) when the whole batch differs from its micro-batches."""
    one, off = {"w": torch.ones(3, dtype=torch.float64)}, {"w": torch.ones(3, dtype=torch.float64) + 1e-3}
    code, lines = verdict(runs(one, one, off), "64-true", ["model.noise", "noise in training_step()"])
    assert code == 1 and lines[-1].startswith(
        "NOT EQUIVALENT in float64: training drew from generators of your own (model.noise, noise in "
        "training_step()): seeded per process, not per sample"
    )
    code, lines = verdict(runs(off, one, one), "64-true", randomness=["torch's"])
    assert code == 1 and lines[-1].startswith(
        "NOT EQUIVALENT in float64: splitting the batch into micro-batches changes the result, and training steps "
        "drew from torch's global generator (randomness of your own"
    )
    # Manual optimization (1 and 2 processes only, a GAN's torch.randn noise in training_step): the noise is named,
    # not the loss and a hand-made all_reduce; a generator of its own too. Without either: the loss and all_reduce.
    manual = {name: state for name, state in runs(off, one, one).items() if name != "1x2"}
    code, lines = verdict(manual, "64-true", randomness=["torch's"])
    assert code == 1 and lines[-1] == (
        "NOT EQUIVALENT in float64: the whole batch on 1 process and its halves on 2 give other weights or optimizer "
        "state, and training steps drew from torch's global generator (randomness of your own: the check turns off "
        "torch's dropout layers only), so a whole batch draws other numbers than its halves on 2 processes. Turn "
        "that randomness off for the check with an override and run it again; if the runs still differ, check the "
        "loss is a mean over the device's batch, and that nothing divides by a global count."
    )
    assert verdict(manual, "64-true", ["noise in training_step()"])[1][-1].startswith(
        "NOT EQUIVALENT in float64: training drew from generators of your own (noise in training_step())"
    )
    assert "hand-made all_reduce" in verdict(manual, "64-true")[1][-1]
