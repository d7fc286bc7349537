"""Samplers whose results do not depend on how many processes share the work."""

import logging
from collections.abc import Iterator, Sized
from typing import Any

import numpy as np

# Lightning's own unpadded sampler: every sample exactly once, ranks may differ by one sample.
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import Sampler

from scaleup.data.permutation import FeistelPermutation
from scaleup.errors import UserError

__all__ = ["GlobalBatchSampler", "UnrepeatedDistributedSampler", "resumed_steps"]

log = logging.getLogger(__name__)

#: Indices computed per numpy call: enough to amortise the calls (~30 ns per index), few to stay at ~1 MB.
CHUNK_INDICES = 16384


class GlobalBatchSampler(Sampler):
    """Training order that depends only on (seed, epoch, global batch size), computed lazily.

    Each epoch is one permutation of the whole dataset, keyed by (seed, epoch) (`FeistelPermutation`: nothing
    is stored, any position is computed on demand), cut into global batches of `global_batch_size`; rank r
    gets the r-th contiguous slice of every global batch. A DataLoader with batch size
    `global_batch_size / (num_replicas x accumulation)` then yields the rank's micro-batches in order, so 1
    device with accumulation 4, 2 devices with 2 and 4 devices with 1 all average gradients over exactly the
    same samples at every optimizer step.

    A rank computes only its own slices, those of as many global batches as make `CHUNK_INDICES` indices at a
    time, as the loader asks: an epoch starts in O(1) time and memory whatever the dataset size
    (docs/data-order.md has the figures at 1e9 samples).

    The tail that does not fill a global batch is dropped (a different tail each epoch): a partial step would
    give ranks unequal batches, and DDP's gradient mean would then weight samples unequally.

    A plain Sampler: the Trainer runs with `use_distributed_sampler=False`, so Lightning leaves it as it is, and
    calls its `set_epoch` every epoch, as it does for any sampler that has one. Use it at world size 1 too: that is
    what makes 1 vs N identical.

    With `with_epoch=True` it yields `(epoch, index)` pairs, for `SeededSamples` (data/seeding.py), which seeds
    each sample's augmentation from them: the epoch travels with the index to whichever worker loads it.
    """

    #: Written into checkpoints (GlobalBatchDataModule.state_dict): a mid-epoch resume needs the same order.
    ORDER = "feistel-v1"

    def __init__(
        self,
        dataset: Sized,
        global_batch_size: int,
        num_replicas: int,
        rank: int,
        seed: int,
        shuffle: bool = True,
        with_epoch: bool = False,
    ) -> None:
        if global_batch_size % num_replicas:
            raise ValueError(f"global batch {global_batch_size} does not split over {num_replicas} ranks")
        self.dataset, self.num_replicas, self.rank, self.seed, self.shuffle = dataset, num_replicas, rank, seed, shuffle
        self.epoch = 0
        self.global_batch_size = global_batch_size
        self.per_rank = global_batch_size // num_replicas
        self.steps_per_epoch = len(dataset) // global_batch_size
        self.num_samples = self.steps_per_epoch * self.per_rank
        self.steps_per_chunk = max(1, CHUNK_INDICES // self.per_rank)
        self._resume_epoch = -1
        self._resume_steps = 0
        self.with_epoch = with_epoch

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next iteration yields (Lightning calls it as each epoch starts)."""
        self.epoch = epoch

    def resume(self, epoch: int, steps_done: int) -> None:
        """Skip the first `steps_done` global batches of `epoch` (a mid-epoch checkpoint); later epochs are whole."""
        self._resume_epoch, self._resume_steps = epoch, steps_done

    def __iter__(self) -> Iterator[int] | Iterator[tuple[int, int]]:
        indices = self._indices()
        return ((self.epoch, index) for index in indices) if self.with_epoch else indices

    def _indices(self) -> Iterator[int]:
        for chunk in self.chunks(self.steps_per_chunk):
            yield from chunk.tolist()

    def chunks(self, steps_per_chunk: int) -> Iterator[np.ndarray]:
        """This rank's indices of the epoch (after the steps a resume skips), `steps_per_chunk` steps at a time."""
        shuffled = self.shuffle and self.steps_per_epoch > 0  # a permutation of nothing does not exist
        order = self.epoch_order() if shuffled else None
        # The positions of this rank's slice in one global batch; step s adds s x global batch.
        slice_positions = np.arange(self.rank * self.per_rank, (self.rank + 1) * self.per_rank, dtype=np.int64)
        skipped = self._resume_steps if self.epoch == self._resume_epoch else 0
        for first in range(skipped, self.steps_per_epoch, steps_per_chunk):
            steps = np.arange(first, min(first + steps_per_chunk, self.steps_per_epoch), dtype=np.int64)
            positions = steps[:, None] * self.global_batch_size + slice_positions
            yield (positions if order is None else order[positions]).ravel()

    def epoch_order(self) -> FeistelPermutation:
        """This epoch's permutation of [0, N): indexed with an array of positions, it gives the samples there.
        A subclass may order the epoch otherwise (the shard-aware window shuffle of sharded data)."""
        return FeistelPermutation(len(self.dataset), self.seed, self.epoch)

    def __len__(self) -> int:
        # The full epoch even when resuming: Lightning restores its batch counter to the steps already taken
        # and ends the epoch when this shorter iterator runs out, so the counts line up.
        return self.num_samples


def resumed_steps(
    written_by: dict[str, Any] | None, checkpoint: str, epoch: int, global_step: int, sampler: GlobalBatchSampler
) -> int:
    """The global batches of `epoch` that a resumed checkpoint already trained on: 0 at an epoch boundary.

    `written_by` is what the checkpoint recorded about its sampler (`GlobalBatchDataModule.state_dict`), None for
    a checkpoint from before the record. Skipping the steps taken is exact only in the order that took them, so
    a mid-epoch checkpoint from another sampler, or with another global batch, is refused. The position in the
    epoch is counted in global batches as the checkpoint counted them: a mid-epoch resume with another global
    batch could continue from the same sample (the order of an epoch does not depend on the global batch), but
    Lightning's step and batch counters and the LR schedule would then count steps of two sizes.
    An epoch-boundary checkpoint of another sampler resumes with one warning: the later epochs are shuffled anew.
    """
    recorded = written_by or {}
    order = recorded.get("sampler", "torch.randperm (before feistel-v1)")
    global_batch = recorded.get("global_batch_size", sampler.global_batch_size)
    steps_per_epoch = len(sampler.dataset) // global_batch
    steps_done = global_step - epoch * steps_per_epoch
    if not 0 < steps_done < steps_per_epoch:
        if order != sampler.ORDER and rank_zero_only.rank == 0:
            log.warning(
                f"{checkpoint} was written with the {order} sampler: the epochs from {epoch} on are shuffled in "
                f"the {sampler.ORDER} order (the same on any device count), not the one that sampler would have used"
            )
        return 0
    if order != sampler.ORDER:
        if order.split(" (")[0] == sampler.ORDER.split(" (")[0]:  # the same sampler, on other shards or windows
            why = (
                f"now {sampler.ORDER}: the shard set or data.window_shards changed since, and the order depends on "
                "both; resume with the shards and window it was written with, or from an epoch-end checkpoint"
            )
        else:
            why = (
                f"whose order this version ({sampler.ORDER}) does not reproduce: resume from an epoch-end "
                "checkpoint, or with the scaleup version that wrote it"
            )
        raise UserError(
            f"{checkpoint} stopped mid-epoch ({steps_done} of epoch {epoch}'s {steps_per_epoch} steps) under the "
            f"{order} sampler, {why}"
        )
    if global_batch != sampler.global_batch_size:
        raise UserError(
            f"{checkpoint} stopped mid-epoch ({steps_done} of epoch {epoch}'s {steps_per_epoch} steps of "
            f"{global_batch} samples): resume it with data.global_batch_size={global_batch}, or change the global "
            "batch at an epoch-end checkpoint"
        )
    return steps_done
