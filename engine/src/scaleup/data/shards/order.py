"""The training order over shards: shards permuted each epoch, samples shuffled within windows of W shards.

Epoch e of seed s (docs/sharded-data.md):
1. the S shards are permuted by `FeistelPermutation(S, key(s, shards), e)`;
2. the permuted list is cut into windows of W consecutive shards (the last may hold fewer);
3. the samples of window j (its shards' samples, in the permuted shard order) are permuted by
   `FeistelPermutation(n_j, key(s, window, j), e)`;
4. the epoch is window 0's shuffled samples, then window 1's, ...

That is a permutation of the split's N samples which, like the map-style one, depends only on (seed, epoch) and
the shard list, never on the topology. `ShardWindowSampler` is `GlobalBatchSampler` with this permutation in
place of the global one: the same global batches of G consecutive positions, the same per-rank slices, the same
skipping of the steps a mid-epoch checkpoint took, the same dropped tail. A global batch then draws from one
window (two at a boundary), so a rank reads the window's W shards at a time, each from its start: sequential
reads, and W shards open per process.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

import numpy as np

from scaleup.data.permutation import FeistelPermutation
from scaleup.data.samplers import GlobalBatchSampler
from scaleup.data.seeding import mixed_seed
from scaleup.data.shards.prefetch import Prefetcher

# Key families of the two permutations; seeding.py's AUGMENTATION and MODEL are 0 and 1.
SHARD_ORDER, WINDOW_ORDER = 2, 3


class ShardWindowOrder:
    """Epoch `epoch`'s order of the samples of shards holding `counts` samples: index it with positions."""

    def __init__(self, counts: np.ndarray, window: int, seed: int, epoch: int) -> None:
        counts = np.asarray(counts, dtype=np.int64)
        self.seed, self.epoch, self.window = seed, epoch, window
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        shards = FeistelPermutation(len(counts), mixed_seed(seed, SHARD_ORDER), epoch)[np.arange(len(counts))]
        self.shard_starts, self.shard_counts = starts[shards], counts[shards]  # in the epoch's shard order
        self.shard_ends = np.cumsum(self.shard_counts)
        self.shard_begins = self.shard_ends - self.shard_counts
        # Window j covers positions [window_ends[j - 1], window_ends[j]) of the epoch.
        ends = self.shard_ends[window - 1 :: window]
        self.window_ends = (
            ends if len(ends) and ends[-1] == self.shard_ends[-1] else np.append(ends, self.shard_ends[-1])
        )
        self._shuffles: dict[int, FeistelPermutation] = {}

    def _shuffle(self, window: int) -> FeistelPermutation:
        if window not in self._shuffles:
            size = int(self.window_ends[window] - (self.window_ends[window - 1] if window else 0))
            self._shuffles = {window: FeistelPermutation(size, mixed_seed(self.seed, WINDOW_ORDER, window), self.epoch)}
        return self._shuffles[window]

    def __getitem__(self, positions: np.ndarray) -> np.ndarray:
        """The split indices of the samples at these epoch positions."""
        positions = np.asarray(positions, dtype=np.int64)
        flat = positions.ravel()
        windows = np.searchsorted(self.window_ends, flat, side="right")
        offsets = np.empty_like(flat)  # each position's place in its window's shuffled order
        for window in np.unique(windows):
            chosen = windows == window
            first = self.window_ends[window - 1] if window else 0
            offsets[chosen] = first + self._shuffle(int(window))[flat[chosen] - first]
        # `offsets` now counts from the epoch's start over the shards in epoch order: find each one's shard.
        shard = np.searchsorted(self.shard_ends, offsets, side="right")
        return (self.shard_starts[shard] + offsets - self.shard_begins[shard]).reshape(positions.shape)


class ShardWindowSampler(GlobalBatchSampler):
    """`GlobalBatchSampler` whose epoch order is the shard-aware window shuffle (`ShardWindowOrder`).

    Its order name, written into checkpoints, carries W and the shard list's checksum: a mid-epoch checkpoint
    resumes only with the same window over the same shards (`samplers.resumed_steps`).
    """

    def __init__(
        self,
        dataset: Sized,
        global_batch_size: int,
        num_replicas: int,
        rank: int,
        seed: int,
        *,
        counts: np.ndarray,
        window: int,
        checksum: str,
        with_epoch: bool = False,
        prefetch: tuple[Prefetcher, int] | None = None,
    ) -> None:
        super().__init__(dataset, global_batch_size, num_replicas, rank, seed, with_epoch=with_epoch)
        self.counts, self.window = counts, window
        self.ORDER = f"shard-window-v1 (window {window}, shards {checksum[:16]})"
        self.prefetch = prefetch  # the prefetcher and its steps per unit (remote shards read by sample)

    def _indices(self) -> Iterator[int]:
        if self.prefetch is None:
            return super()._indices()
        prefetcher, steps = self.prefetch
        return prefetcher.ahead(self.chunks(steps))  # the same indices, fetched before the loader asks

    def epoch_order(self) -> ShardWindowOrder:
        return ShardWindowOrder(self.counts, self.window, self.seed, self.epoch)
