"""Samplers whose results do not depend on how many processes share the work."""

from collections.abc import Iterator, Sized

import torch

# Lightning's own unpadded sampler: every sample exactly once, ranks may differ by one sample.
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DistributedSampler

__all__ = ["GlobalBatchSampler", "UnrepeatedDistributedSampler"]


class GlobalBatchSampler(DistributedSampler):
    """Training order that depends only on (seed, epoch, global batch size).

    Each epoch the whole dataset is shuffled with one generator seeded by `seed + epoch` and cut into global
    batches of `global_batch_size`; rank r gets the r-th contiguous slice of every global batch. A DataLoader
    with batch size `global_batch_size / (num_replicas x accumulation)` then yields the rank's micro-batches in
    order, so 1 device with accumulation 4, 2 devices with 2 and 4 devices with 1 all average gradients over
    exactly the same samples at every optimizer step.

    The tail that does not fill a global batch is dropped (a different tail each epoch): a partial step would
    give ranks unequal batches, and DDP's gradient mean would then weight samples unequally.

    Being a `DistributedSampler`, Lightning leaves it in place instead of injecting its own, and calls
    `set_epoch` on it every epoch. Use it at world size 1 too: that is what makes 1 vs N identical.
    """

    def __init__(
        self, dataset: Sized, global_batch_size: int, num_replicas: int, rank: int, seed: int, shuffle: bool = True
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        if global_batch_size % num_replicas:
            raise ValueError(f"global batch {global_batch_size} does not split over {num_replicas} ranks")
        self.global_batch_size = global_batch_size
        self.per_rank = global_batch_size // num_replicas
        self.steps_per_epoch = len(dataset) // global_batch_size
        self.total_size = self.steps_per_epoch * global_batch_size
        self.num_samples = self.steps_per_epoch * self.per_rank
        self._resume_epoch = -1
        self._resume_steps = 0

    def resume(self, epoch: int, steps_done: int) -> None:
        """Skip the first `steps_done` global batches of `epoch` (a mid-epoch checkpoint); later epochs are whole."""
        self._resume_epoch, self._resume_steps = epoch, steps_done

    def _skipped_steps(self) -> int:
        return self._resume_steps if self.epoch == self._resume_epoch else 0

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator)
        else:
            order = torch.arange(len(self.dataset))
        batches = order[: self.total_size].view(self.steps_per_epoch, self.global_batch_size)
        mine = batches[self._skipped_steps() :, self.rank * self.per_rank : (self.rank + 1) * self.per_rank]
        return iter(mine.reshape(-1).tolist())

    def __len__(self) -> int:
        # The full epoch even when resuming: Lightning restores its batch counter to the steps already taken
        # and ends the epoch when this shorter iterator runs out, so the counts line up.
        return self.num_samples
