"""1 vs N devices on CPU with 2 real processes (gloo): same weights, exact metrics, random numbers by position,
LR plan.

The runs are the shared float64 baselines (conftest `baseline`): 3 epochs, 24 optimizer steps of AdamW, with
dropout 0.5 and random augmentation, on 1 process (accumulating 2 micro-batches of 32, from the cap), on 2
processes x 32 loading with 2 workers each, and on 1 process with accumulation 2 set by hand, all with the same
global batch of 64.
"""

import math
import sys
from dataclasses import replace

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
    ROOT,
    TOLERANCE,
    TOPOLOGIES,
    assert_same_weights,
    clean_env,
    in_process,
    read_json,
    run_command,
    warmup_cosine,
    weights,
)
from scaleup.check_equivalence import explanations, verdict
from scaleup.check_equivalence import main as check_equivalence
from scaleup.plan.resolve import Plan

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


def equivalence_check(monkeypatch, overrides):
    monkeypatch.chdir(ROOT)
    for name in ("PYTHONPATH", "OMP_NUM_THREADS"):  # its runs find engine/tests/probes.py and share the 2 cores
        monkeypatch.setenv(name, clean_env()[name])
    return check_equivalence(overrides)


def test_equivalence_check_catches_a_global_count_loss():
    """The tool's own runs, in float64, on the seeds' pitfall: a loss divided by the global batch. Accumulating 2
    micro-batches on one process halves its gradient, as 2 processes would. Run as the README says, with
    `python -m`: the callback it hands its runs must be importable there (not `__main__.DrawnGenerators`)."""
    command = [sys.executable, "-m", "scaleup.check_equivalence", "model.net.norm=group"]
    command.append("model._target_=probes.GlobalCountLoss")
    proc = run_command(command)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert out.startswith("comparing 2 CPU processes, 1 accumulating 2 micro-batches and 1 with the whole batch")
    assert "NOT EQUIVALENT in float64: splitting the batch into micro-batches changes the result" in out
    print(out)


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


def test_equivalence_verdict_compares_optimizer_state_not_running_statistics():
    """BatchNorm's running statistics differ by design (2 processes keep rank 0's, 1 accumulating 2 updates them by
    every micro-batch): named, not compared. The optimizer state must agree: a gradient scaled by a constant shows
    in Adam's moments even where Adam's update hides it from the weights."""
    w = torch.ones(3, dtype=torch.float64)
    bn = {"net.1.weight": w, "net.1.running_mean": w, "net.1.running_var": w, "net.1.num_batches_tracked": 8}
    rank0 = {**bn, "net.1.running_mean": w / 2, "net.1.running_var": w * 3, "net.1.num_batches_tracked": 4}
    bn, rank0 = ({k: torch.as_tensor(v) for k, v in state.items()} for state in (bn, rank0))
    code, lines = verdict(runs(bn, bn, rank0), "64-true")
    assert code == 0 and lines[0].endswith("difference 0.00e+00 (net.1.weight), tolerance 1e-10")
    assert lines[2] == (
        "not compared, different by design: the running statistics of net.1 (BatchNorm): 2 processes keep rank 0's, "
        "updated by its micro-batches only, 1 process updates them by every micro-batch"
    )
    moments = {0: {"exp_avg": w, "step": torch.tensor(8.0)}}
    halved = {0: {"exp_avg": w / 2, "step": torch.tensor(8.0)}}
    code, lines = verdict(runs(bn, bn, bn, (moments, halved, halved)), "64-true")
    assert code == 1 and lines[1] == (
        "1 process: whole batch vs 2 x half: largest relative difference 5.00e-01 "
        "(optimizer_states[0].state[0].exp_avg), tolerance 1e-10"
    )


def test_equivalence_verdict_names_what_the_plans_explain(baseline):
    """The default model's BatchNorm (64 samples per statistic in the whole batch, 32 per micro-batch) and dropout
    make the whole batch differ from its micro-batches by design; a generator of the user's own that training drew
    from is named when 2 processes differ from the same micro-batches on 1."""
    one, off = {"w": torch.ones(3, dtype=torch.float64)}, {"w": torch.ones(3, dtype=torch.float64) + 1e-3}
    plan = Plan.from_dict(read_json(baseline("one") / "plan.json"))
    plans = {
        "1": replace(plan, has_batchnorm=True, bn_batch_size=64, per_device_batch_size=64),
        "1x2": replace(plan, has_batchnorm=True, bn_batch_size=32, per_device_batch_size=32),
    }
    reasons = explanations(plans, {"net": {"norm": "batch", "dropout": 0.5}})
    assert reasons == [
        "BatchNorm: its statistics come from 64 samples in one batch and 32 per micro-batch, so those runs "
        "normalise differently by design",
        "dropout (model.net.dropout=0.5): masks are drawn per micro-batch, so a batch of 64 and micro-batches of 32 "
        "draw different ones",
    ]
    code, lines = verdict(runs(off, one, one), "64-true", reasons)
    assert code == 0 and lines[-2].startswith("the whole batch differs from its micro-batches by design: BatchNorm")
    code, lines = verdict(runs(one, one, off), "64-true", reasons, ["model.noise"])
    assert code == 1 and lines[-1].startswith(
        "NOT EQUIVALENT in float64: training drew from generators of your own (model.noise): seeded once per process"
    )
    without = replace(plan, has_batchnorm=False)
    assert explanations({"1": without, "1x2": without}, {"net": {"dropout": 0}}) == []
