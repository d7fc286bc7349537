"""Manual optimization (`automatic_optimization = False`): the plan's steps are global batches.

user_modules.TwoOptimizerGAN (model=two_optimizers) steps a generator's and a discriminator's optimizer once per batch,
so Lightning's global_step is twice the batches trained. The LR schedule, the step seed, trainer.max_steps and a
mid-epoch resume count batches (plan/progress.py); the one-line refusals of accumulation are in test_errors' CASES.
"""

import re
import sys

import pytest

from conftest import (
    QUICK,
    assert_same_weights,
    in_process,
    read_json,
    run,
    run_command,
    save_every,
    warmup_cosine,
    weights,
)
from scaleup.checkpoints.io import load_checkpoint
from scaleup.errors import EXIT_USER_ERROR, UNUSED_PARAMETERS, as_user_error

# Digits: 1257 training samples, 9 global batches of 128 per epoch. max_steps=16 batches end 7 batches into epoch 1
# (max_epochs=3 would allow 27); the LR warms up over the first 9 batches from the base LR (tuned at 64) to twice it,
# then decays (cosine) to 0 at batch 16. The discriminator's LR is half the generator's at every batch.
GAN = [
    *QUICK,
    "model=two_optimizers",
    "logger=none",
    "data.global_batch_size=128",
    "lr_schedule.base_batch_size=64",
    "lr_schedule.warmup_epochs=1",
    "trainer.max_epochs=3",
    "trainer.max_steps=16",
]
BATCHES, WARMUP = 16, 9


def lr_probe(run_dir):
    return ["+callbacks.lr._target_=probes.LRProbe", f"+callbacks.lr.path={run_dir}/lrs.json"]


def batches_trained(checkpoint):
    return checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["processed"]


@pytest.fixture(scope="module")
def gan_run(tmp_path_factory):
    """The 16 batches on 1 process, with every param group's LR at each batch (probes.LRProbe) and a checkpoint every 3
    of Lightning's steps (ModelCheckpoint's every_n_train_steps counts optimizer.step() calls): steps/at-24.ckpt is
    after batch 12, 3 batches into epoch 1."""
    run_dir = tmp_path_factory.mktemp("gan") / "run"
    in_process([*GAN, *lr_probe(run_dir), *save_every("at3", 3), f"hydra.run.dir={run_dir}"])
    return run_dir


def test_the_plan_the_lr_schedule_and_max_steps_count_batches(gan_run):
    """Before: the run stopped at global_step 16 after 8 batches, and the schedule ran twice as fast (the decay from
    batch 4.5, LR 0 from batch 8 on)."""
    plan = read_json(gan_run / "plan.json")
    assert plan["manual_optimization"] is True
    assert (plan["total_steps"], plan["warmup_steps"], plan["steps_per_epoch"]) == (BATCHES, WARMUP, 9)
    assert plan["base_lrs"] == {"SGD/pg1": 0.1, "SGD-1/pg1": 0.05}  # the generator's, and the discriminator's
    assert (
        "warmup / total steps  9 / 16 (cosine decay); a step is a global batch (manual optimization), however many "
        "optimizer.step() calls it makes"
    ) in (gan_run / "train.log").read_text()
    last = load_checkpoint(gan_run / "checkpoints/last.ckpt")
    assert (batches_trained(last), last["global_step"]) == (BATCHES, 2 * BATCHES)

    lrs = read_json(gan_run / "lrs.json")
    assert sorted(map(int, lrs)) == list(range(BATCHES))
    for batch, ((generator,), (discriminator,)) in lrs.items():
        expected = warmup_cosine(int(batch), 0.1, 0.2, WARMUP, BATCHES)
        assert generator == pytest.approx(expected, rel=1e-12, abs=1e-15), batch
        assert discriminator == pytest.approx(expected / 2, rel=1e-12, abs=1e-15), batch
    # the base, 4 of 9 warmup batches up, the peak, 3 of 7 decay batches down: hard-coded, not from any formula
    assert [lrs[batch][0][0] for batch in ("0", "4", "9", "12")] == pytest.approx([0.1, 0.144444, 0.2, 0.122252], 1e-5)


def test_a_mid_epoch_resume_trains_exactly_the_remaining_batches(gan_run, tmp_path):
    """From after batch 12 (3 of epoch 1's 9): batches 12 to 15, at the uninterrupted run's LRs, to its weights. Before:
    the checkpoint's global_step 24 put the run 15 batches into epoch 1, past its end."""
    in_process([*GAN, *lr_probe(tmp_path), f"ckpt_path={gan_run / 'steps/at-24.ckpt'}", f"hydra.run.dir={tmp_path}"])
    resumed = read_json(tmp_path / "lrs.json")
    assert sorted(map(int, resumed)) == [12, 13, 14, 15]
    assert resumed == {batch: lr for batch, lr in read_json(gan_run / "lrs.json").items() if int(batch) >= 12}
    assert batches_trained(load_checkpoint(tmp_path / "checkpoints/last.ckpt")) == BATCHES
    last = "checkpoints/last.ckpt"
    assert_same_weights(weights(gan_run / last), weights(tmp_path / last), rtol=0, atol=0)


@pytest.mark.slow
def test_the_equivalence_check_compares_1_and_2_processes_without_accumulation():
    """Lightning cannot accumulate under manual optimization: the check trains 8 batches of 64 on 2 processes and on
    1 with the whole batch, in float64, and the two runs end with the same weights and optimizer state. Before: it
    crashed ('Automatic gradient accumulation is not supported for manual optimization', exit 2); then its first
    line said it compared "1 accumulating 2 micro-batches" too. With the settings the one-line error advises
    (test_the_advised_settings_train_on_two_processes_without_torchs_warning)."""
    result = run_command(
        [
            sys.executable,
            "-m",
            "scaleup.check_equivalence",
            "model=two_optimizers",
            "model.toggle=true",
            "strategy.find_unused_parameters=true",
        ]
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert result.stdout.splitlines()[0] == (
        "comparing 2 CPU processes and 1 with the whole batch after 8 steps in float64 (manual optimization "
        "(automatic_optimization=False): Lightning cannot accumulate, so no accumulation run)"
    )
    difference = re.search(r"2 processes vs 1 with the whole batch: largest relative difference (\S+) ", output)
    assert difference and float(difference[1]) <= 1e-12, output[-3000:]
    assert "no accumulation run" in output and "EQUIVALENT in float64" in output
    print(f"2 processes vs 1 with the whole batch: {difference[1]}")


@pytest.mark.slow
def test_unused_parameters_on_two_processes_are_one_line_naming_the_templates_key(tmp_path):
    """The discriminator's loss leaves the generator without gradients: DDP's reducer refuses the next backward. Before:
    a traceback ending in Lightning's advice, strategy='ddp_find_unused_parameters_true', which the config refuses."""
    result = run([*GAN, "trainer.devices=2", "trainer.max_steps=2", f"hydra.run.dir={tmp_path}"])
    output = result.stdout + result.stderr
    assert result.returncode == EXIT_USER_ERROR, output[-3000:]
    assert "Traceback" not in output and "ddp_find_unused_parameters_true" not in output
    # Both ranks fail alike: the first to fail prints the error, the other says so in one line (before, with torch's
    # error, 7 lines, in it). Where the other rank's watchdog reads the failure first, its line has no "too".
    for line in output.splitlines():
        if re.match(r"rank \d: stopped: ", line):
            assert re.fullmatch(
                r"rank (\d): stopped: rank (?!\1)\d failed( \(this rank failed too: the same error\))?; "
                r"(its error follows|rank 0 prints its error)",
                line,
            ), line
    assert "Expected to have finished reduction" not in output
    # the failing rank's line, however the ranks' failures are introduced ("rank 1: error: ...")
    assert result.stderr.strip().splitlines()[-1].endswith(f"error: {UNUSED_PARAMETERS}"), output[-3000:]
    assert "set strategy.find_unused_parameters=true" in UNUSED_PARAMETERS

    # Only DDP's reducer raising it is the mistake: the same words raised by a user's own code are a bug there.
    def training_step():
        raise RuntimeError("Expected to have finished reduction in the prior iteration before starting a new one")

    with pytest.raises(RuntimeError) as raised:
        training_step()
    assert as_user_error(raised.value) is None


@pytest.mark.slow
def test_the_advised_settings_train_on_two_processes_without_torchs_warning(tmp_path):
    """UNUSED_PARAMETERS advises strategy.find_unused_parameters=true and, under manual optimization, each optimizer's
    part of the step in `self.toggled_optimizer` (model.toggle=true): each backward then leaves the other network's
    parameters out. With the flag alone torch warns on both ranks that DDP "did not find any unused parameters" (in
    the generator's backward, which reaches the discriminator too; measured: 2 processes, 4 steps, the same weights
    bitwise either way); strategy.static_graph=true fails there (the two backwards use different parameters)."""
    assert "set strategy.find_unused_parameters=true" in UNUSED_PARAMETERS
    assert "`with self.toggled_optimizer(opt):`" in UNUSED_PARAMETERS
    advised = ["strategy.find_unused_parameters=true", "model.toggle=true"]
    result = run([*GAN, *advised, "trainer.devices=2", "trainer.max_steps=2", f"hydra.run.dir={tmp_path}"])
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "unused parameters" not in output
