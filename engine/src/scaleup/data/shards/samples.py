"""Reading samples by byte range: a rank fetches from the remote only the samples it trains or evaluates on.

The index says where every member's payload lies in its shard (`ShardIndex.spans`), so the members of a set of
samples are one batch of ranged reads: `fsspec`'s `cat_ranges` (concurrent requests on s3fs and gcsfs), the
samples of a shard that lie next to each other (a rank's contiguous evaluation run) merged into one range.
`read_samples` returns them as one buffer and a table of where each member lies in it: what the prefetcher
writes to local disk (`prefetch.py`) and what a loader worker reads directly when no prefetcher fetched it.
"""

from __future__ import annotations

from dataclasses import dataclass

import fsspec
import numpy as np

from scaleup.data.shards.format import BLOCK
from scaleup.data.shards.index import ShardIndex
from scaleup.data.shards.remote import with_retries
from scaleup.errors import UserError

#: Samples of a shard at most this many bytes apart are read in one range (the gap is a tar header or two).
MERGE_GAP = 2 * BLOCK


@dataclass
class SampleBytes:
    """The members of some samples: `table[i, f]` is (offset, size) of sample `samples[i]`'s field f in `buffer`."""

    samples: np.ndarray  # split indices, sorted
    buffer: memoryview
    table: np.ndarray  # (samples, fields, 2), int64

    def members(self, row: int) -> list[memoryview]:
        return [self.buffer[offset : offset + size] for offset, size in self.table[row].tolist()]


def read_samples(index: ShardIndex, fs: fsspec.AbstractFileSystem, root: str, samples: np.ndarray) -> SampleBytes:
    """The members of `samples` (split indices) read from the shards under `root` on `fs`, with retries."""
    samples = np.unique(np.asarray(samples, dtype=np.int64))
    shards, local = index.locate(samples)
    spans = np.stack([index.spans[shard][row] for shard, row in zip(shards.tolist(), local.tolist(), strict=True)])
    # A sample's members lie together, in any order (ShardWriter sorts them by name, the index lists the input first).
    begins, finishes = spans[:, :, 0].min(1), (spans[:, :, 0] + spans[:, :, 1]).max(1)
    # Ranges over the samples in shard and offset order; `starts[r]` is where range r begins in its shard.
    order = np.lexsort((begins, shards))
    range_of = np.empty(len(samples), dtype=np.int64)
    names, starts, stops = [], [], []
    for i in order.tolist():
        shard = int(shards[i])
        if names and names[-1] == shard and begins[i] - stops[-1] <= MERGE_GAP:
            stops[-1] = max(stops[-1], int(finishes[i]))
        else:
            names.append(shard)
            starts.append(int(begins[i]))
            stops.append(int(finishes[i]))
        range_of[i] = len(names) - 1
    paths = [f"{root}/{index.names[shard]}" for shard in names]
    url = index.shard_url(names[0]) if len(set(names)) == 1 else f"{index.url} ({len(set(names))} shards)"
    pieces = with_retries(lambda: _cat_ranges(fs, paths, starts, stops), url)
    placed = np.cumsum([0] + [len(piece) for piece in pieces])[:-1]  # where each range lands in the buffer
    table = spans.copy()
    table[:, :, 0] += (placed[range_of] - np.asarray(starts)[range_of])[:, None]
    return SampleBytes(samples, memoryview(b"".join(pieces)), table)


def _cat_ranges(fs: fsspec.AbstractFileSystem, paths: list[str], starts: list[int], stops: list[int]) -> list[bytes]:
    """fsspec's batched ranged reads; an error in any range is raised (fsspec returns it in the list)."""
    pieces = fs.cat_ranges(paths, starts, stops, on_error="return")
    for piece in pieces:
        if isinstance(piece, BaseException):
            raise piece
    for piece, start, stop, path in zip(pieces, starts, stops, paths, strict=True):
        if len(piece) != stop - start:
            raise UserError(
                f"shard {path} ends before byte {stop}: it changed after its index was written; restore it, or "
                "convert again and start a new run"
            )
    return pieces
