"""Random numbers that depend on the data and the step, never on the topology or on an interruption.

Training draws random numbers in two places, and each is seeded from what it works on:
- augmentation, in the dataset's `__getitem__` (in whichever rank or loader worker loads the sample): python's,
  numpy's and torch's global generators are seeded from (seed, epoch, sample index) before each sample
  (`SeededSamples`);
- in-model randomness (dropout, stochastic depth, noise), in the forward pass: the same generators (torch's on
  the CPU and on the process's GPU) are seeded, before each micro-batch, from (seed, optimizer step, the
  micro-batch's offset in the global batch) (`StepSeed`).

Both are pure functions of the data's position, so 1 device and N devices, any number of loader workers, and a
run resumed anywhere draw the same numbers; ranks and workers still draw different numbers for different
samples. Dropout masks are drawn per micro-batch tensor, so they match between topologies that use the same
per-device batch (1 device accumulating 2 x 32 and 2 devices x 32), not between 1 x 64 and 2 x 32.
docs/randomness.md says what to do with generators of your own.
"""

from __future__ import annotations

import random
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import Dataset

from scaleup.plan.batch import resolve_batch
from scaleup.plan.progress import steps_done

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


class StepSeed(L.Callback):
    """Before each training micro-batch, seeds the generators from (seed, optimizer step, the micro-batch's
    offset in the global batch), so dropout and other in-model randomness draw the same numbers for the same
    samples at the same step, whatever the split over devices and accumulation, and after a resume.

    Replaces one seed per rank at the start of training, which made masks depend on the rank and a resumed run
    draw a fresh stream. `seed_everything(seed)` before the model is built still gives every rank the same
    initial weights.
    """

    def __init__(self, seed: int, global_batch_size: int) -> None:
        self.seed, self.global_batch_size = seed, global_batch_size
        self._step: int | None = None
        self._micro_batch = 0
        self._stream = mixed_seed(seed, MODEL)  # the keys every step shares, mixed once
        self._rank_offset = self._per_device = 0
        self._gpu_generator: torch.Generator | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The topology is fixed for the fit (and settled by now, also by AutoBatchSize): read from the Trainer's
        # properties once, not at every step.
        batch = resolve_batch(self.global_batch_size, None, trainer.world_size, trainer.accumulate_grad_batches)
        self._per_device = batch.per_device
        self._rank_offset = micro_batch_offset(trainer.global_rank, batch.accumulation, 0, batch.per_device)
        # The process's GPU generator itself: `torch.cuda.manual_seed` looks it up through a lazy-init queue.
        device = pl_module.device
        if device.type == "cuda":
            index = torch.cuda.current_device() if device.index is None else device.index
            self._gpu_generator = torch.cuda.default_generators[index]

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # Counted from the plan's step (the optimizer step; the global batch under manual optimization) rather than
        # from batch_idx: a checkpoint always falls between two steps, so after a resume the first micro-batch is a
        # step's first, whatever Lightning's batch counters say.
        step = steps_done(trainer)
        self._micro_batch = self._micro_batch + 1 if step == self._step else 0
        self._step = step
        offset = self._rank_offset + self._micro_batch * self._per_device  # micro_batch_offset
        seed = mixed_seed(step, offset, start=self._stream)
        seed_host_generators(seed)
        if self._gpu_generator is not None:
            self._gpu_generator.manual_seed(seed)
