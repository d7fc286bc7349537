"""World-size-invariant training order and unpadded evaluation, on the samplers themselves."""

import itertools
import logging

import numpy as np
import pytest
import torch

from conftest import QUICK, in_process, save_every
from scaleup.checkpoints.io import load_checkpoint
from scaleup.data.permutation import FeistelPermutation
from scaleup.data.samplers import GlobalBatchSampler, resumed_steps
from scaleup.errors import UserError


def flat(lists) -> list[int]:
    return list(itertools.chain.from_iterable(lists))


N, GLOBAL = 103, 16  # 6 global batches per epoch, 7 samples dropped


def global_batches(world: int, accumulation: int, epoch: int, seed: int = 3) -> list[list[int]]:
    """The optimizer-step batches as sets of sample ids, rebuilt from what each rank's loader would yield."""
    per_device = GLOBAL // (world * accumulation)
    per_rank = []
    for rank in range(world):
        sampler = GlobalBatchSampler(range(N), GLOBAL, num_replicas=world, rank=rank, seed=seed)
        sampler.set_epoch(epoch)
        order = list(sampler)
        assert len(order) == len(sampler) == (N // GLOBAL) * GLOBAL // world
        micro = [order[i : i + per_device] for i in range(0, len(order), per_device)]
        per_rank.append([flat(micro[s * accumulation : (s + 1) * accumulation]) for s in range(N // GLOBAL)])
    return [sorted(flat(per_rank[r][s] for r in range(world))) for s in range(N // GLOBAL)]


@pytest.mark.parametrize(("world", "accumulation"), [(2, 1), (1, 2), (4, 1), (2, 2), (8, 2)])
def test_global_batches_do_not_depend_on_topology(world, accumulation):
    assert global_batches(world, accumulation, epoch=1) == global_batches(1, 1, epoch=1)


def test_each_epoch_covers_distinct_samples_once_and_order_changes():
    epoch0, epoch1 = global_batches(2, 1, 0), global_batches(2, 1, 1)
    flat0 = flat(epoch0)
    assert len(flat0) == len(set(flat0)) == (N // GLOBAL) * GLOBAL
    assert epoch0 != epoch1
    assert global_batches(2, 1, 0) == epoch0  # same seed, same order
    assert global_batches(2, 1, 0, seed=4) != epoch0


def test_resume_skips_the_steps_already_taken_in_that_epoch_only():
    sampler = GlobalBatchSampler(range(N), GLOBAL, num_replicas=2, rank=1, seed=0)
    sampler.set_epoch(2)
    full = list(sampler)
    sampler.resume(epoch=2, steps_done=4)
    assert list(sampler) == full[4 * GLOBAL // 2 :]
    assert len(sampler) == len(full)  # Lightning counts the epoch's batches from the full length
    sampler.set_epoch(3)
    assert len(list(sampler)) == len(full)


def test_resume_on_another_device_count_continues_with_the_same_global_batches():
    """Stopped on 2 ranks after 4 steps of epoch 2, resumed on 1: the steps left are the ones the 2 ranks had left."""

    def remaining(world: int) -> list[list[int]]:
        per_rank = []
        for rank in range(world):
            sampler = GlobalBatchSampler(range(N), GLOBAL, num_replicas=world, rank=rank, seed=0)
            sampler.set_epoch(2)
            sampler.resume(epoch=2, steps_done=4)
            order, share = list(sampler), GLOBAL // world
            per_rank.append([order[i : i + share] for i in range(0, len(order), share)])
        return [sorted(flat(step)) for step in zip(*per_rank, strict=True)]

    assert remaining(1) == remaining(2) == remaining(4) == global_batches(1, 1, epoch=2, seed=0)[4:]


def test_global_batches_are_consecutive_runs_of_one_permutation_of_the_epoch():
    """The order's definition, rebuilt from the permutation alone: global batch s is positions [s G, (s + 1) G)."""
    order = FeistelPermutation(N, seed=3, epoch=1)[np.arange(N)].tolist()
    expected = [sorted(order[s * GLOBAL : (s + 1) * GLOBAL]) for s in range(N // GLOBAL)]
    assert global_batches(4, 1, epoch=1) == expected
    sampler = GlobalBatchSampler(range(N), GLOBAL, num_replicas=4, rank=2, seed=3)
    sampler.set_epoch(1)
    assert list(sampler)[: GLOBAL // 4] == order[2 * GLOBAL // 4 : 3 * GLOBAL // 4]  # rank 2's slice of step 0


def test_without_shuffle_the_order_is_the_dataset_order():
    sampler = GlobalBatchSampler(range(N), GLOBAL, num_replicas=2, rank=1, seed=0, shuffle=False)
    assert list(sampler)[:10] == [*range(8, 16), 24, 25]


def test_a_trillion_samples_start_at_once():
    """No epoch list: 10^12 indices would take 8 TB. Rank 3 of 8 draws its first micro-batches lazily."""
    sampler = GlobalBatchSampler(range(10**12), 1024, num_replicas=8, rank=3, seed=0)
    sampler.set_epoch(5)
    sampler.resume(epoch=5, steps_done=10**8)  # deep into the epoch, at no cost either
    first = list(itertools.islice(iter(sampler), 1000))
    assert len(sampler) == 10**12 // 1024 * 128 and len(set(first)) == 1000
    assert min(first) >= 0 and max(first) < 10**12
    permutation = FeistelPermutation(10**12, seed=0, epoch=5)
    assert first[:128] == permutation[10**8 * 1024 + 3 * 128 + np.arange(128)].tolist()


def recorded(sampler_name: str = GlobalBatchSampler.ORDER, global_batch: int = GLOBAL) -> dict:
    return {"sampler": sampler_name, "global_batch_size": global_batch}


def test_a_resume_skips_only_the_steps_the_checkpoint_took_in_its_order(caplog):
    sampler = GlobalBatchSampler(range(N), GLOBAL, num_replicas=2, rank=0, seed=0)  # 6 steps per epoch
    assert resumed_steps(recorded(), "a.ckpt", epoch=2, global_step=16, sampler=sampler) == 4
    assert resumed_steps(recorded(), "a.ckpt", epoch=2, global_step=12, sampler=sampler) == 0  # epoch boundary
    # Global batch 32 at the checkpoint: 3 steps per epoch, so step 6 of epoch 2 was its boundary.
    assert resumed_steps(recorded(global_batch=32), "a.ckpt", epoch=2, global_step=6, sampler=sampler) == 0
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        assert resumed_steps(None, "old.ckpt", epoch=2, global_step=12, sampler=sampler) == 0
    assert caplog.messages == [
        "old.ckpt was written with the torch.randperm (before feistel-v1) sampler: the epochs from 2 on are "
        "shuffled in the feistel-v1 order (the same on any device count), not the one that sampler would have used"
    ]


@pytest.mark.parametrize(
    ("written_by", "global_step", "message"),
    [
        (
            None,
            16,
            r"^old.ckpt stopped mid-epoch \(4 of epoch 2's 6 steps\) under the torch.randperm \(before feistel-v1\) "
            r"sampler, whose order this version \(feistel-v1\) does not reproduce: resume from an epoch-end "
            r"checkpoint, or with the scaleup version that wrote it$",
        ),
        (recorded("feistel-v0"), 16, "under the feistel-v0 sampler"),
        (
            recorded(global_batch=8),
            28,
            r"^old.ckpt stopped mid-epoch \(4 of epoch 2's 12 steps of 8 samples\): resume it with "
            r"data.global_batch_size=8, or change the global batch at an epoch-end checkpoint$",
        ),
    ],
)
def test_a_mid_epoch_resume_in_another_order_is_refused(written_by, global_step, message):
    sampler = GlobalBatchSampler(range(N), GLOBAL, num_replicas=2, rank=0, seed=0)
    with pytest.raises(UserError, match=message):
        resumed_steps(written_by, "old.ckpt", epoch=2, global_step=global_step, sampler=sampler)


def test_checkpoints_name_their_order_and_an_older_mid_epoch_one_is_refused(tmp_path):
    """A real checkpoint at step 3 of 19; the same one without the record, as every checkpoint before it."""
    short = [*QUICK, "logger=none", "data.num_workers=0", "model.net.width=4"]
    in_process([*short, "trainer.max_steps=3", *save_every("mid", 3), f"hydra.run.dir={tmp_path / 'run'}"])
    checkpoint = load_checkpoint(tmp_path / "run/steps/at-3.ckpt")
    assert checkpoint["DigitsDataModule"] == {"sampler": "feistel-v1", "global_batch_size": 64}
    del checkpoint["DigitsDataModule"]
    torch.save(checkpoint, tmp_path / "old.ckpt")
    with pytest.raises(UserError, match=r"old.ckpt stopped mid-epoch \(3 of epoch 0's 19 steps\) under the torch"):
        in_process([*short, "trainer.max_steps=6", f"ckpt_path={tmp_path / 'old.ckpt'}", f"hydra.run.dir={tmp_path}"])
    assert not (tmp_path / "plan.json").exists()  # refused before anything was written
