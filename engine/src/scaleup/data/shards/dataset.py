"""A split stored in shards, as a map-style dataset: sample i is read from the shard that holds it."""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from scaleup.data.shards.cache import ShardCache
from scaleup.data.shards.format import IMAGE_TYPES, ShardFormatError, decode_field
from scaleup.data.shards.index import ShardIndex
from scaleup.data.shards.prefetch import Spool
from scaleup.data.shards.remote import filesystem
from scaleup.data.shards.samples import read_samples
from scaleup.errors import UserError


class ShardSplit(Dataset):
    """Random access to the samples of one split's shards: `split[i]` is sample i as the converter stored it,
    its fields decoded (`format.decode_field`) and `transform` applied to the first one (the input).

    The order of access is the sampler's business (`ShardWindowSampler`, or the contiguous evaluation shards).
    Two ways to read, `reads`:

    - `"shards"`: whole shards, kept open a few at a time (`ShardCache`: a local directory in place, a remote's
      shards copied whole into the node's cache), in each process its own, made on first use after the dataset
      reached that process (a loader worker);
    - `"samples"`: each micro-batch's samples by byte range (`__getitems__`, `samples.read_samples`), from the
      units the rank's prefetcher wrote to `spool` when it has one (training), else directly from the remote.

    Without a transform, an image field becomes float32 in [0, 1], unless `uint8_images` (the data module then
    normalises the batches on the device).
    """

    def __init__(
        self,
        index: ShardIndex,
        transform: Any = None,
        uint8_images: bool = False,
        cache_dir: str | None = None,
        cache_bytes: int = 50 << 30,
        keep_open: int = 2,
        reads: str = "shards",
    ) -> None:
        self.index, self.transform, self.uint8_images = index, transform, uint8_images
        self.cache_dir, self.cache_bytes, self.keep_open = cache_dir, cache_bytes, keep_open
        self.reads = reads
        self.spool: Path | None = None  # the rank's prefetched units (reads="samples", training)
        self._image = index.fields[0].rsplit(".", 1)[-1].lower() in IMAGE_TYPES
        self._cache: ShardCache | None = None
        self._cache_pid = os.getpid()
        self._fetched: dict[int, list[memoryview]] = {}  # the current micro-batch's members (reads="samples")
        self._reader: tuple[int, Any, str, Spool | None] | None = None  # pid, filesystem, root, spool

    def __len__(self) -> int:
        return int(self.index.ends[-1])

    def __getstate__(self) -> dict[str, Any]:
        # Open memory maps and a remote's client stay in the process that opened them.
        return {**self.__dict__, "_cache": None, "_reader": None, "_fetched": {}}

    @property
    def cache(self) -> ShardCache:
        """This process's cache, made on first use. A forked loader worker inherits its parent's (rank 0 asks it
        whether it is large enough) and makes its own: a remote's client is not fork-safe (s3fs refuses to run)."""
        if self._cache is None or self._cache_pid != os.getpid():
            self._cache = ShardCache(self.index, self.cache_dir, self.cache_bytes, self.keep_open)
            self._cache_pid = os.getpid()
        return self._cache

    def locate(self, index: int) -> tuple[int, int]:
        """(shard, sample within the shard) of sample `index`."""
        if not 0 <= index < len(self):
            raise IndexError(index)
        shard, local = self.index.locate(np.asarray(index))
        return int(shard), int(local)

    def __getitems__(self, indices: list[int]) -> list[tuple[Any, ...]]:
        """A micro-batch (what the DataLoader asks for): with reads="samples", its bytes fetched together first."""
        self.fetch(indices)
        return [self[index] for index in indices]

    def fetch(self, indices: list[int]) -> None:
        """reads="samples": bring the members of `indices` into this process (from the rank's prefetched units,
        else by byte range from the shards), for the `__getitem__` calls that follow."""
        if self.reads != "samples":
            return
        fs, root, spool = self._samples_reader()
        self._fetched, missing = {}, []  # only this micro-batch's members stay
        for index in indices:
            members = spool.members(index) if spool is not None else None
            if members is None:
                missing.append(index)
            else:
                self._fetched[index] = members
        if missing:
            fetched = read_samples(self.index, fs, root, np.asarray(missing))
            self._fetched.update((int(index), fetched.members(row)) for row, index in enumerate(fetched.samples))

    def _samples_reader(self) -> tuple[Any, str, Spool | None]:
        """This process's filesystem client, root and spool: made again in a forked worker (s3fs is not fork-safe)."""
        if self._reader is None or self._reader[0] != os.getpid():
            fs, root = filesystem(self.index.url)
            spool = Spool(self.spool, len(self.index.fields)) if self.spool is not None else None
            self._reader = (os.getpid(), fs, root, spool)
        return self._reader[1:]

    def _members(self, index: int, shard: int, local: int) -> list[memoryview]:
        if self.reads == "samples":
            if index not in self._fetched:
                self.fetch([index])
            return self._fetched[index]
        opened = self.cache.shard(shard)
        return [opened.field(local, i) for i in range(len(self.index.fields))]

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        shard, local = self.locate(index)
        members = self._members(index, shard, local)
        self.check(index, shard, local, members)
        try:
            values = [decode_field(name, data) for name, data in zip(self.index.fields, members, strict=True)]
        except (ShardFormatError, RuntimeError, ValueError) as err:  # e.g. torchvision: an undecodable JPEG
            raise UserError(
                f"sample {index} of shard {self.index.shard_url(shard)} cannot be decoded ({err}); the shard is "
                "corrupt: convert the data again or restore it"
            ) from None
        first = values[0]
        if self.transform is not None:
            first = self.transform(first)
        elif self._image and not self.uint8_images:
            first = first.to(torch.float32) / 255
        return (first, *values[1:])

    def check(self, index: int, shard: int, local: int, members: list[memoryview]) -> None:
        """Compare each member's crc32 with the index's (from the cache, a local disk or a remote alike): a sample
        with a changed byte is refused before it is decoded, never trained on. An index without them: unchecked."""
        expected = self.index.crc32[shard]
        if expected is None:
            return
        for field, data, crc in zip(self.index.fields, members, expected[local], strict=True):
            if zlib.crc32(data) != crc:
                split = self.index.url.rsplit("/", 1)[-1]
                raise UserError(
                    f"sample {index} of shard {self.index.shard_url(shard)} (split {split}) fails its checksum: its "
                    f"{field} has crc32 {zlib.crc32(data):08x}, the index says {int(crc):08x}; the shard is corrupt: "
                    "restore it, or convert the data again"
                )
