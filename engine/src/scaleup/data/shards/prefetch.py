"""The rank's next training samples, fetched to local disk in the background before its loader asks for them.

A rank's sampler knows the rank's whole epoch in advance. With remote shards read by sample (`reads=samples`),
`Prefetcher` (in the rank's main process) cuts the sampler's indices into units of a few steps and, before the
loader sees a unit's indices, announces the unit (`unit-N.want.npy`: its samples) and queues it for its
background thread, which fetches the unit's byte ranges (`samples.read_samples`) and writes them as
`unit-N.bin` with their table `unit-N.npy`. It stays `AHEAD` units ahead of the loader, and keeps the last
`KEEP` units on disk: the budget `data.prefetch_mb` bounds the disk used, about KEEP units.

The loader workers read the units there (`Spool`): a sample that an announced unit holds is waited for, never
fetched twice; any other sample (an evaluation, a sample of a unit already deleted) is read directly.
Whatever the prefetcher does, a sample's bytes are the same, and its checksum is checked when it is read: the
prefetch changes when bytes arrive, never which.
"""

from __future__ import annotations

import atexit
import mmap
import os
import queue
import shutil
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from scaleup.data.shards.index import ShardIndex
from scaleup.data.shards.remote import GIVE_UP_S, filesystem
from scaleup.data.shards.samples import SampleBytes, read_samples
from scaleup.errors import UserError

AHEAD = 2  # units fetched ahead of the one the loader is taking indices from
KEEP = AHEAD + 3  # units on disk: those ahead, the current one, and two the workers may still be reading
ERROR = "error.txt"
POLL_S = 0.002


def unit_steps(budget_bytes: int, index: ShardIndex, per_rank: int) -> int:
    """Steps per unit: KEEP units of this rank's share of the steps fit in the budget (one step at least)."""
    sample_bytes = sum(index.sizes) / len(index)
    return max(1, int(budget_bytes / KEEP / (per_rank * sample_bytes)))


class Prefetcher:
    """Fetches the samples a sampler yields, `AHEAD` units ahead, into `directory` (this process's own)."""

    def __init__(self, index: ShardIndex, spool_root: Path) -> None:
        self.index = index
        host = socket.gethostname()
        _remove_stale(spool_root, host)
        self.directory = spool_root / f"{host}-{os.getpid()}-{index.checksum[:12]}"
        self.directory.mkdir(parents=True, exist_ok=True)
        atexit.register(shutil.rmtree, self.directory, ignore_errors=True)
        self._next_unit = 0
        self._queue: queue.Queue[tuple[int, np.ndarray]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    def ahead(self, units: Iterable[np.ndarray]) -> Iterator[int]:
        """The indices of `units` in order, each unit announced and queued `AHEAD` units before it is yielded."""
        pending: list[np.ndarray] = []
        for unit in units:
            self._want(unit)
            pending.append(unit)
            if len(pending) > AHEAD:
                yield from self._take(pending)
        while pending:
            yield from self._take(pending)

    def _take(self, pending: list[np.ndarray]) -> list[int]:
        if self.error is not None:  # the main process stops with the fetch's message (num_workers=0 too)
            raise UserError(self.error)
        return pending.pop(0).tolist()

    def _want(self, samples: np.ndarray) -> None:
        unit, self._next_unit = self._next_unit, self._next_unit + 1
        _save(self.directory / f"unit-{unit:08d}.want.npy", samples)
        for old in range(max(0, unit - 2 * KEEP), unit - KEEP + 1):
            for suffix in (".want.npy", ".npy", ".bin"):
                (self.directory / f"unit-{old:08d}{suffix}").unlink(missing_ok=True)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="scaleup-prefetch", daemon=True)
            self._thread.start()
        self._queue.put((unit, samples))

    def _run(self) -> None:
        fs, root = filesystem(self.index.url)
        while True:
            unit, samples = self._queue.get()
            try:
                self._write(unit, read_samples(self.index, fs, root, samples))
            except Exception as err:  # the workers waiting for this unit stop with the message, in one line
                self.error = str(err) if isinstance(err, UserError) else f"prefetching {self.index.url}: {err!r}"
                (self.directory / ERROR).write_text(self.error)
                return

    def _write(self, unit: int, fetched: SampleBytes) -> None:
        stem = self.directory / f"unit-{unit:08d}"
        partial = stem.with_suffix(".bin.partial")
        partial.write_bytes(fetched.buffer)
        os.replace(partial, stem.with_suffix(".bin"))
        table = np.concatenate([fetched.samples[:, None], fetched.table.reshape(len(fetched.samples), -1)], 1)
        _save(stem.with_suffix(".npy"), table)  # last: the unit is complete once its table is there


def _save(path: Path, array: np.ndarray) -> None:
    """Write an array where readers find only whole files."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as file:
        np.save(file, array)
    os.replace(partial, path)


def _remove_stale(spool_root: Path, host: str) -> None:
    """Delete the spools this host's ended processes left (a killed run does not clean up)."""
    for spool in spool_root.glob(f"{host}-*-*"):
        owner, pid, _ = spool.name.rsplit("-", 2)  # a host name may hold dashes; the pid and checksum do not
        if owner != host or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(spool, ignore_errors=True)
        except PermissionError:  # another user's live process
            pass


class Spool:
    """A loader worker's view of its rank's prefetched units: the members of a sample an announced unit holds."""

    def __init__(self, directory: Path, fields: int) -> None:
        self.directory, self.fields = directory, fields
        self._announced: dict[int, int] = {}  # sample -> unit
        self._seen: set[int] = set()  # units whose announcement was read
        self._units: OrderedDict[int, tuple[SampleBytes, dict[int, int]]] = OrderedDict()  # loaded units

    def members(self, sample: int) -> list[memoryview] | None:
        """The sample's members from its unit (waited for while it is fetched), or None when no unit holds it."""
        unit = self._announced.get(sample)
        if unit is None:
            self._read_announcements()
            unit = self._announced.get(sample)
            if unit is None:
                return None
        if unit not in self._units and not self._load(unit):
            return None
        fetched, rows = self._units[unit]
        return fetched.members(rows[sample])

    def _read_announcements(self) -> None:
        for path in sorted(self.directory.glob("unit-*.want.npy")):
            unit = int(path.name[5:13])
            if unit in self._seen:
                continue
            try:
                samples = np.load(path)
            except FileNotFoundError:  # deleted since the listing: that unit is gone
                continue
            self._seen.add(unit)
            self._announced.update(dict.fromkeys(samples.tolist(), unit))

    def _load(self, unit: int) -> bool:
        """Map the unit once its table is written; False when it was deleted (the caller reads directly)."""
        stem = self.directory / f"unit-{unit:08d}"
        give_up = time.monotonic() + 2 * GIVE_UP_S
        while not stem.with_suffix(".npy").exists():
            if (self.directory / ERROR).exists():
                raise UserError((self.directory / ERROR).read_text())
            if not stem.with_suffix(".want.npy").exists() or time.monotonic() > give_up:
                return False
            time.sleep(POLL_S)
        try:
            table = np.load(stem.with_suffix(".npy"))
            with open(stem.with_suffix(".bin"), "rb") as file:  # mapped: the page cache holds it, not the worker
                buffer = memoryview(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ))
        except FileNotFoundError:
            return False
        samples = table[:, 0]
        fetched = SampleBytes(samples, buffer, table[:, 1:].reshape(len(samples), self.fields, 2))
        self._units[unit] = (fetched, {sample: row for row, sample in enumerate(samples.tolist())})
        while len(self._units) > KEEP:
            old, (gone, _) = self._units.popitem(last=False)
            for sample in gone.samples.tolist():
                if self._announced.get(sample) == old:
                    del self._announced[sample]
        return True
