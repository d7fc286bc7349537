"""Sharded checkpoints written in the background (`checkpoint.async_save`): training waits while its state is
copied, not while the copy is written.

`torch.distributed.checkpoint.async_save` copies (stages) every rank's shards into fresh CPU memory before it
returns, so the checkpoint holds the step it was taken at while training goes on changing the tensors, and writes
the copy from a thread. Its collectives (the write plan, the gather of every rank's results) run on a gloo process
group of its own, created once: on training's group they would interleave, from another thread, with the step's.

As atomic as the synchronous save (sharded.save_sharded): the shards go into `.<name>.partial/`; rank 0's write
completes only after DCP has gathered every rank's results and written `.metadata`, and only then does rank 0 write
meta.pt (Lightning's loops and callbacks, captured at save time) and put the directory in place. One save is in
flight at a time: the next one waits for it, and `wait` (at the end of every stage, also a stopped one) too.
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from scaleup.checkpoints.sharded import METADATA, PARTIAL, beside, complete, prepare

log = logging.getLogger("scaleup")


def split(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lightning's checkpoint as ModelParallelStrategy.save_checkpoint lays it out on disk (what
    sharded.read_sharded reads): the shards (`state_dict`, `optimizer_<i>`) and the rest, for meta.pt."""
    meta = dict(checkpoint)
    shards = {"state_dict": meta.pop("state_dict")}
    shards.update({f"optimizer_{i}": state for i, state in enumerate(meta.pop("optimizer_states", []))})
    return shards, meta


class BackgroundSaver:
    """Writes one sharded checkpoint at a time in the background; every rank holds one and calls `save` together."""

    def __init__(self, timeout: timedelta | None = None) -> None:
        self._timeout = timeout
        self._group: Any = None
        # One thread: what it is given (a save's completion, a removal after it) runs in order.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._pending: Future | None = None

    def _process_group(self) -> Any:
        if self._group is None:
            # Created on every rank at its first save, which all ranks reach together.
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
        return self._group

    def save(self, shards: dict[str, Any], meta: dict[str, Any], path: Path, *, is_global_zero: bool) -> None:
        """Wait for the previous save, stage `shards` and capture `meta`, and return; they are written to `path`
        in the background."""
        start = time.perf_counter()
        self.wait()
        group = self._process_group()
        if is_global_zero:
            prepare(path)
        dist.barrier(group=group)  # no rank writes into `.<name>.partial/` before rank 0 has emptied it
        captured = None
        if is_global_zero:
            captured = io.BytesIO()
            torch.save(meta, captured)  # now: the callbacks' state is live (e.g. ModelCheckpoint's best_k_models)
        written = dcp.async_save(shards, checkpoint_id=beside(path, PARTIAL), process_group=group)
        paused = time.perf_counter() - start
        meta_bytes = captured.getvalue() if captured else None
        self._pending = self._thread.submit(self._finish, written, group, path, meta_bytes, start, paused)

    def _finish(self, written: Future, group: Any, path: Path, meta: bytes | None, start: float, paused: float) -> None:
        """Background: once every rank's shards are written, rank 0 adds meta.pt and puts the directory in place;
        every rank returns when it is there."""
        try:
            written.result()  # rank 0's: after DCP gathered every rank's results and wrote .metadata
            if meta is not None:
                (beside(path, PARTIAL) / METADATA).write_bytes(meta)
                complete(path)
                took = time.perf_counter() - start
                log.info(f"saved {path} in the background: training waited {paused:.2f} s, the save took {took:.2f} s")
        finally:
            dist.barrier(group=group)  # also after a failed save: no rank is left waiting for the others

    def then(self, action: Callable[[], None]) -> None:
        """Run `action` (e.g. removing the checkpoint this one replaces) once the save in flight is in place; not
        at all if it failed."""
        previous = self._pending

        def after() -> None:
            if previous is not None:
                previous.result()
            action()

        self._pending = self._thread.submit(after)

    def wait(self) -> None:
        """Return once the save in flight (if any) is in place on every rank; raise its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
