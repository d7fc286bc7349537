"""World-size-invariant training order and unpadded evaluation, on the samplers themselves."""

import itertools

import pytest
import torch

from scaleup.engine.samplers import GlobalBatchSampler, UnrepeatedDistributedSampler


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


def test_unrepeated_eval_sampler_counts_every_sample_once():
    seen = []
    for rank in range(4):
        seen += list(UnrepeatedDistributedSampler(range(13), num_replicas=4, rank=rank, shuffle=False))
    assert sorted(seen) == list(range(13))


def test_distributed_sampler_would_pad():
    """Why we don't use the default: torch's DistributedSampler repeats samples to even out the ranks."""
    seen = []
    for rank in range(4):
        seen += list(torch.utils.data.DistributedSampler(range(13), num_replicas=4, rank=rank, shuffle=False))
    assert len(seen) == 16 and len(set(seen)) == 13


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
