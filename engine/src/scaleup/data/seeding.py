"""Random numbers that depend on the data and the step, never on the topology or on an interruption.

Training draws random numbers in two places, and each is seeded from what it works on:
- augmentation, in the dataset's `__getitem__` (in whichever rank or loader worker loads the sample): python's,
  numpy's and torch's global generators are seeded from (seed, epoch, sample index) before each sample
  (`SeededSamples`);
- in-model randomness (dropout, stochastic depth, noise), in the forward pass: the same generators (torch's on
  the CPU and on the process's GPU) are seeded, before each micro-batch, from (seed, optimizer step, the
  micro-batch's offset in the global batch) (`scaleup.callbacks.step_seed.StepSeed`).

Both are pure functions of the data's position, so 1 device and N devices, any number of loader workers, and a
run resumed anywhere draw the same numbers; ranks and workers still draw different numbers for different
samples. Dropout masks are drawn per micro-batch tensor, so they match between topologies that use the same
per-device batch (1 device accumulating 2 x 32 and 2 devices x 32), not between 1 x 64 and 2 x 32.
docs/randomness.md says what to do with generators of your own.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

# Distinct first keys keep the two families of streams apart: sample 5 of epoch 3 and step 3 at offset 5
# must not draw the same numbers.
AUGMENTATION, MODEL = 0, 1


_MASK = 2**64 - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's step (the golden-ratio increment, then the finaliser that data/permutation.py's `mix64` applies
    to arrays) on one Python int, which is faster than numpy scalars for a single value: a bijection of 64-bit
    integers in which every input bit flips each output bit with probability ~1/2."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def mixed_seed(*keys: int, start: int = 0) -> int:
    """A 64-bit seed mixed from non-negative integer keys: unrelated streams for neighbouring keys, not seed + 1
    neighbours. Each key is folded in through SplitMix64: about 1 us for 4 keys, where numpy's SeedSequence takes
    12 us, and this runs for every sample loaded. `start`, a seed mixed from the first keys, continues the fold:
    mixed_seed(c, d, start=mixed_seed(a, b)) == mixed_seed(a, b, c, d)."""
    mixed = start
    for key in keys:
        mixed = _splitmix64(mixed ^ key)
    return mixed


def seed_host_generators(seed: int) -> None:
    """Seed python's, numpy's and torch's CPU generator."""
    random.seed(seed)
    np.random.seed(seed % 2**32)  # numpy's legacy global generator takes 32 bits
    torch.default_generator.manual_seed(seed)


def seed_generators(seed: int) -> None:
    """Seed python's, numpy's and torch's CPU generator, and the current GPU's when CUDA is in use.

    Not `torch.manual_seed`: it also probes every accelerator backend, 300 us on a CPU-only machine against 4 us
    for the CPU generator itself. Under DDP each process uses one GPU, the current one.
    """
    seed_host_generators(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed(seed)


class SeededSamples(Dataset):
    """A map-style dataset whose every sample is loaded with the global generators seeded from (seed, epoch,
    index): random augmentation in the wrapped dataset's `__getitem__` gives sample i of epoch e the same
    transform in any rank and any loader worker, on any device count and after any resume.

    Keys are `(epoch, index)` pairs (what `GlobalBatchSampler(with_epoch=True)` yields: the epoch travels with
    the index, so persistent workers, whose copy of the dataset never sees the main process's updates, know it)
    or plain indices (evaluation: epoch 0, the same transform every time).

    The generators are left seeded, not restored: in a worker nothing else draws from them, and in the main
    process (num_workers=0) `StepSeed` reseeds them before every micro-batch, after the batch was loaded.
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: int | tuple[int, int]) -> Any:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        seed_generators(mixed_seed(self.seed, AUGMENTATION, epoch, index))
        return self.dataset[index]

    def __getitems__(self, keys: list) -> list:
        """A micro-batch: a dataset that reads a batch's bytes together (`fetch`, sharded data) does so first,
        then each sample is loaded under its own seed."""
        if hasattr(self.dataset, "fetch"):
            self.dataset.fetch([key[1] if isinstance(key, tuple) else key for key in keys])
        return [self[key] for key in keys]


def micro_batch_offset(rank: int, accumulation: int, micro_batch: int, per_device: int) -> int:
    """Where a micro-batch starts in its global batch: rank r holds the r-th contiguous slice of accumulation x
    per-device samples (GlobalBatchSampler), cut in order into micro-batches of per-device samples."""
    return (rank * accumulation + micro_batch) * per_device
