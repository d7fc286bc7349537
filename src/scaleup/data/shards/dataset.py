"""A split stored in shards, as a map-style dataset: sample i is read from the shard that holds it."""

from __future__ import annotations

import os
import zlib
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from scaleup.data.shards.cache import ShardCache
from scaleup.data.shards.format import IMAGE_TYPES, ShardFormatError, decode_field
from scaleup.data.shards.index import ShardIndex
from scaleup.errors import UserError


class ShardSplit(Dataset):
    """Random access to the samples of one split's shards: `split[i]` is sample i as the converter stored it,
    its fields decoded (`format.decode_field`) and `transform` applied to the first one (the input).

    The order of access is the sampler's business (`ShardWindowSampler`, or the contiguous evaluation shards): it
    asks for the samples of a few shards at a time, and this dataset keeps those open (`ShardCache`), in each
    process its own, made on first use after the dataset reached that process (a loader worker).
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
    ) -> None:
        self.index, self.transform, self.uint8_images = index, transform, uint8_images
        self.cache_dir, self.cache_bytes, self.keep_open = cache_dir, cache_bytes, keep_open
        self._ends = np.cumsum(index.counts)
        self._image = index.fields[0].rsplit(".", 1)[-1] in IMAGE_TYPES
        self._cache: ShardCache | None = None
        self._cache_pid = os.getpid()

    def __len__(self) -> int:
        return int(self._ends[-1])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": None}  # open memory maps stay in the process that opened them

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
        shard = int(np.searchsorted(self._ends, index, side="right"))
        return shard, index - int(self._ends[shard] - self.index.counts[shard])

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        shard, local = self.locate(index)
        opened = self.cache.shard(shard)
        members = [opened.field(local, i) for i in range(len(self.index.fields))]
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
