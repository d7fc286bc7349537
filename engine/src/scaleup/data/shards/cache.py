"""Opening shards: in place from a local directory, or fetched whole into a bounded local cache from a remote.

Every process (rank or loader worker) keeps the shards of its current shuffle window open, memory-mapped: the
page cache, not the process, holds their bytes, and the ranks and workers of a node share it. A remote shard is
copied once per node into `cache_dir` (a lock per shard: the first process fetches, the others wait and find it),
its sha256 checked against the index; the least recently used shards are deleted to keep the whole cache
directory (every split and shard set in it) within `cache_bytes`, counting the shards other processes are fetching
at the same time (each reserves its bytes before it fetches).
A full disk evicts the rest of the cache and tries again, then reads the shard into memory: bounded, never a crash.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import io
import logging
import mmap
import os
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from filelock import FileLock

from scaleup.data.shards.format import ShardFormatError, scan
from scaleup.data.shards.index import ShardIndex
from scaleup.data.shards.remote import filesystem, is_local, with_retries
from scaleup.errors import UserError

log = logging.getLogger(__name__)

COPY_BYTES = 8 << 20  # a remote shard is copied in pieces of 8 MiB
RESERVED = ".reserved-"  # `.reserved-<pid>-<shard>.size`: a sparse file as large as the shard that pid is fetching


def default_cache_dir() -> str:
    return str(Path(tempfile.gettempdir()) / "scaleup-shard-cache")


@dataclass
class OpenShard:
    """One shard's bytes (memory-mapped or in memory) and where each sample's fields lie in them."""

    buffer: memoryview
    spans: np.ndarray  # (samples, fields, 2): offset, size

    def field(self, sample: int, field: int) -> memoryview:
        offset, size = self.spans[sample, field]
        return self.buffer[offset : offset + size]


class ShardCache:
    """The shards of one index, opened on demand; at most `keep_open` at a time in this process."""

    def __init__(self, index: ShardIndex, cache_dir: str | None, cache_bytes: int, keep_open: int) -> None:
        self.index, self.cache_bytes, self.keep_open = index, int(cache_bytes), max(1, keep_open)
        self.fs, self.root = filesystem(index.url)
        self.local = is_local(self.fs)
        # One folder per index URL and checksum: another shard set never reads this one's files.
        tag = hashlib.sha256(f"{index.url}\0{index.checksum}".encode()).hexdigest()[:16]
        self.cache_root = Path(cache_dir or default_cache_dir())  # the limit covers all of it, every split
        self.dir = self.cache_root / tag
        self._open: OrderedDict[int, OpenShard] = OrderedDict()
        self._warned_memory = False

    def too_small(self) -> str:
        """Why the cache cannot hold the shards a process keeps open (they would be fetched again), or ""."""
        needed = self.keep_open * max(self.index.sizes)
        if self.local or needed <= self.cache_bytes:
            return ""
        return (
            f"data.cache_gb={self.cache_bytes / 2**30:.3g} holds fewer than the {self.keep_open} shards of "
            f"{self.index.url} a process keeps open ({needed / 2**30:.3g} GB): shards will be fetched more than once "
            "per epoch; raise data.cache_gb"
        )

    def shard(self, shard: int) -> OpenShard:
        if shard in self._open:
            self._open.move_to_end(shard)
            return self._open[shard]
        opened = self._load(shard)
        self._open[shard] = opened
        while len(self._open) > self.keep_open:
            self._open.popitem(last=False)
        return opened

    def _load(self, shard: int) -> OpenShard:
        url = self.index.shard_url(shard)
        if self.local:
            buffer = self._map(Path(f"{self.root}/{self.index.names[shard]}"), url, shard)
        else:
            buffer = self._remote(shard, url)
        spans = self.index.spans[shard]
        if spans is None:  # an index without them: walk the tar headers
            try:
                _, spans = scan(buffer, int(self.index.starts[shard]), int(self.index.counts[shard]))
            except ShardFormatError as err:
                raise UserError(f"shard {url} is corrupt: {err}; convert the data again or restore the shard") from None
        return OpenShard(buffer, spans)

    def _map(self, path: Path, url: str, shard: int) -> memoryview:
        try:
            return self._mmap(path, url, shard)
        except FileNotFoundError:
            raise UserError(f"shard {url} is missing (listed in {self.index.url}/index.json)") from None
        except OSError as err:
            raise UserError(f"shard {url} cannot be read: {err}") from None

    def _mmap(self, path: Path, url: str, shard: int) -> memoryview:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size != self.index.sizes[shard]:
                raise UserError(self._changed(url, f"{size} bytes, the index says {self.index.sizes[shard]}"))
            return memoryview(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ))

    def _changed(self, url: str, what: str) -> str:
        return (
            f"shard {url} changed after its index was written ({what}; index checksum {self.index.checksum[:12]}): "
            "the shard set is not the one this run started with; restore it, or convert again and start a new run"
        )

    def _remote(self, shard: int, url: str) -> memoryview:
        size = self.index.sizes[shard]
        path = self.dir / self.index.names[shard]
        if size > self.cache_bytes:  # cannot be cached at all: read it into memory
            return memoryview(self._fetch_to_memory(shard, url))
        self.dir.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # another process may evict the shard between its fetch and its opening here
            with FileLock(str(path) + ".lock"):
                cached = stat_or_none(path)  # another process's eviction does not take this lock
                if not (cached and cached.st_size == size) and not self._fetch_cached(shard, url, path):
                    return memoryview(self._fetch_to_memory(shard, url))
                with contextlib.suppress(FileNotFoundError):
                    os.utime(path)  # most recently used
                    return self._mmap(path, url, shard)  # mapped, it stays readable when evicted
        self._warn_memory(f"the cache in {self.dir} evicts shards before they are opened (data.cache_gb is small)")
        return memoryview(self._fetch_to_memory(shard, url))

    def _fetch_cached(self, shard: int, url: str, path: Path) -> bool:
        """Fetch the shard into the cache, making room first; False when even an emptied cache's disk is full."""
        size = self.index.sizes[shard]
        reservation = self._evict(keep=path, incoming=size, reserve=size)
        try:
            self._fetch(shard, url, path)
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
            self._evict(keep=path, incoming=self.cache_bytes, reserve=size)  # the disk is fuller than our limit says
            try:
                self._fetch(shard, url, path)
            except OSError as again:
                if again.errno != errno.ENOSPC:
                    raise
                self._warn_memory(f"the disk under {self.dir} is full")
                return False
        finally:
            reservation.unlink(missing_ok=True)
        return True

    def _warn_memory(self, why: str) -> None:
        if not self._warned_memory:
            log.warning(f"{why}: shards are read into memory instead of the cache (data.cache_dir, data.cache_gb)")
            self._warned_memory = True

    def _evict(self, keep: Path, incoming: int, reserve: int) -> Path:
        """Delete the least recently used cached shards, of any split or shard set in the cache directory, until
        `incoming` more bytes fit within the limit beside what other processes are fetching; returns this process's
        reservation of the `reserve` bytes it fetches (delete it once the shard is in place, or given up)."""
        with FileLock(str(self.cache_root / ".evict.lock")):
            shards = (p for p in self.cache_root.glob("*/*.tar") if p != keep and not p.name.startswith(".partial-"))
            cached = sorted((stat.st_mtime_ns, stat.st_size, p) for p in shards if (stat := stat_or_none(p)))
            reservation = keep.with_name(f"{RESERVED}{os.getpid()}-{keep.name}.size")
            # A fetcher deletes its reservation outside this lock, once its shard is in place: one listed here may be
            # gone by the time it is sized.
            fetching = (p for p in self.cache_root.glob(f"*/{RESERVED}*") if p != reservation and fetching_now(p))
            used = sum(stat.st_size for p in fetching if (stat := stat_or_none(p))) + sum(s for _, s, _ in cached)
            for _, size, victim in cached:
                if used + incoming <= self.cache_bytes:
                    break
                used -= size
                victim.unlink(missing_ok=True)  # a process that has it mapped keeps reading it
            with open(reservation, "wb") as sparse:
                sparse.truncate(reserve)
        return reservation

    def _fetch(self, shard: int, url: str, path: Path) -> None:
        part = path.with_name(f".partial-{os.getpid()}-{path.name}")
        try:
            sink, digest = self._copy(shard, url, functools.partial(Path.open, part, "wb"))
            sink.close()
            self._check_digest(shard, url, digest)
            os.replace(part, path)
        finally:
            part.unlink(missing_ok=True)

    def _fetch_to_memory(self, shard: int, url: str) -> bytes:
        self._warn_memory(f"shard {url} is larger than data.cache_gb")
        sink, digest = self._copy(shard, url, io.BytesIO)
        self._check_digest(shard, url, digest)
        return sink.getvalue()

    def _copy(self, shard: int, url: str, open_sink: Callable[[], BinaryIO]) -> tuple[BinaryIO, str]:
        """Copy the whole shard into a fresh `open_sink()` (each try starts again): the sink and its sha256."""
        remote_path = f"{self.root}/{self.index.names[shard]}"

        def read() -> tuple[BinaryIO, str]:
            digest, sink = hashlib.sha256(), open_sink()
            try:
                with self.fs.open(remote_path, "rb") as source:
                    while piece := source.read(COPY_BYTES):
                        digest.update(piece)
                        sink.write(piece)
            except BaseException:
                sink.close()
                raise
            return sink, digest.hexdigest()

        return with_retries(read, url)

    def _check_digest(self, shard: int, url: str, digest: str) -> None:
        if digest != self.index.sha256[shard]:
            raise UserError(self._changed(url, f"sha256 {digest[:12]}, the index says {self.index.sha256[shard][:12]}"))


def stat_or_none(path: Path) -> os.stat_result | None:
    """`path`'s stat, or None when there is no such file (another process may delete it at any moment)."""
    try:
        return path.stat()
    except FileNotFoundError:
        return None


def fetching_now(reservation: Path) -> bool:
    """Whether the process that made `reservation` still runs; a reservation left by a killed process is deleted."""
    pid = int(reservation.name[len(RESERVED) :].split("-", 1)[0])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        reservation.unlink(missing_ok=True)
        return False
    except PermissionError:
        pass  # another user's process: running
    return True
