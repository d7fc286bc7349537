"""Random numbers by position, never by topology: the template's seeds, more ranks than 2, and the equivalence
check's view of a generator of the user's own.

The 1 vs 2 processes vs accumulation, num_workers 0 vs 2 and resume proofs with dropout and augmentation on are
the shared float64 baselines' (test_ddp, test_resume, test_any_device_count); 2 nodes x 2 processes through
torchrun is test_launchers'.
"""

import json
import random

import numpy as np
import pytest
import torch

from conftest import (
    EXACT_EPOCHS,
    TOLERANCE,
    WIDE,
    assert_same_weights,
    check,
    in_process,
    read_json,
    run,
    weights,
)
from scaleup.check_equivalence import GENERATORS, RUNS, run_arguments
from scaleup.data.seeding import SeededSamples, micro_batch_offset, mixed_seed, seed_generators
from testbed.data import DigitsDataModule


def test_a_micro_batch_offset_is_its_place_in_the_global_batch():
    """Rank r holds the r-th slice of accumulation x per-device samples: 2 devices x 32 and 1 device accumulating
    2 x 32 put their micro-batches at the same offsets; 4 devices x 16 and 2 accumulating 2 x 16 too."""
    assert [micro_batch_offset(rank, 1, 0, 32) for rank in range(2)] == [0, 32]
    assert [micro_batch_offset(0, 2, j, 32) for j in range(2)] == [0, 32]
    assert [micro_batch_offset(rank, 1, 0, 16) for rank in range(4)] == [
        micro_batch_offset(rank, 2, j, 16) for rank in range(2) for j in range(2)
    ]


def test_seeds_are_a_function_of_their_keys_and_unrelated_for_neighbours():
    assert mixed_seed(42, 1, 3, 32) == mixed_seed(42, 1, 3, 32) == mixed_seed(3, 32, start=mixed_seed(42, 1))
    neighbours = {mixed_seed(42, family, step, offset) for family in (0, 1) for step in (3, 4) for offset in (0, 32)}
    assert len(neighbours) == 8
    seed_generators(mixed_seed(42, 1, 3, 32))
    first = (torch.rand(4), np.random.rand(4), random.random())
    seed_generators(mixed_seed(42, 1, 3, 32))
    again = (torch.rand(4), np.random.rand(4), random.random())
    assert torch.equal(first[0], again[0]) and np.array_equal(first[1], again[1]) and first[2] == again[2]


def test_an_augmented_sample_depends_on_seed_epoch_and_index_only():
    """Whatever was drawn before, and whichever process loads it: the same transform for (seed, epoch, index)."""
    data = DigitsDataModule(global_batch_size=64, augment=True)
    data.setup()
    samples = SeededSamples(data.splits["train"], seed=42)
    image = samples[(1, 5)][0]
    torch.rand(100)  # another stream position
    assert torch.equal(samples[(1, 5)][0], image)
    assert not torch.equal(samples[(2, 5)][0], image)  # a new epoch, a new transform
    assert not torch.equal(SeededSamples(data.splits["train"], seed=43)[(1, 5)][0], image)
    assert torch.equal(samples[5][0], samples[(0, 5)][0])  # a plain index (evaluation) is epoch 0


def test_a_split_that_draws_no_random_numbers_loads_unseeded():
    """Digits without augmentation: the training loader yields the samples in the sampler's order, without
    touching the global generators (no seeding per sample); with augmentation, every sample reseeds them."""
    for augment in (False, True):
        data = DigitsDataModule(global_batch_size=16, augment=augment, num_workers=0)
        data.setup()
        loader = data.train_dataloader()
        state = random.getstate()
        images, _ = next(iter(loader))
        assert (random.getstate() == state) is not augment
        if not augment:  # the sampler yields plain indices, not (epoch, index) keys
            order = next(iter(loader.batch_sampler))
            assert torch.equal(images, torch.stack([data.splits["train"][i][0] for i in order]))


@pytest.mark.slow
def test_three_processes_equal_one(wide_reference, tmp_path):
    """3 processes x 16 x accumulation 4 against 1 process x 16 x accumulation 12: the same micro-batches, the
    same dropout masks and augmentations, the same float64 weights."""
    probe = ["+callbacks.probe._target_=probes.RankProbe", f"+callbacks.probe.out_dir={tmp_path / 'probe'}"]
    check(run([*WIDE, "trainer.devices=3", *probe, f"hydra.run.dir={tmp_path}"]))
    plan = read_json(tmp_path / "plan.json")
    assert (plan["world_size"], plan["per_device_batch_size"], plan["accumulate_grad_batches"]) == (3, 16, 4)
    assert [read_json(tmp_path / f"probe/rank{r}.json")["rank"] for r in range(3)] == [0, 1, 2]
    assert read_json(wide_reference / "plan.json")["accumulate_grad_batches"] == 12
    last = torch.load(tmp_path / "checkpoints/last.ckpt", weights_only=True)
    assert last["global_step"] == 2 * EXACT_EPOCHS
    worst = assert_same_weights(
        weights(wide_reference / "checkpoints/last.ckpt"), last["state_dict"], rtol=0, atol=TOLERANCE
    )
    print(f"3 processes vs 1: largest weight difference {worst:.1e}")


@pytest.mark.slow  # an end-to-end run
@pytest.mark.parametrize(
    ("model", "own", "randomness"),
    [
        ("OwnGeneratorNoise", ["model.noise"], []),  # made in __init__
        ("LazyGeneratorNoise", ["model.noise"], []),  # made in the first training_step, kept as an attribute
        ("StepGeneratorNoise", ["noise in training_step()"], []),  # made in every training_step, a local variable
        ("FunctionalDropout", [], ["torch's"]),  # F.dropout: the global generator, which no layer's eval() stops
    ],
)
def test_the_equivalence_check_names_a_generator_of_the_users_own(tmp_path, model, own, randomness):
    """What `python -m scaleup.check_equivalence` names when its runs differ, from one of its runs (8 steps, its own
    arguments and callbacks): the module's own generators that training drew from, wherever they were made, and the
    global generators that its steps still drew from once the check held BatchNorm and dropout layers."""
    in_process(run_arguments(*RUNS["1x2"], [f"model._target_=probes.{model}"], tmp_path))
    assert json.loads((tmp_path / GENERATORS).read_text()) == {"own": own, "global": randomness}
