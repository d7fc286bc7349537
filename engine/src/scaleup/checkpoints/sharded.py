"""Sharded checkpoints (torch.distributed.checkpoint directories): atomic writes, and reads on one process.

On disk a sharded checkpoint is a directory named like a checkpoint file (`last.ckpt/`, `best-epoch002-0.97.ckpt/`):
`meta.pt` (Lightning's loop, callback and scaleup state: a plain `torch.save`) beside `.metadata` and one
`__<rank>_0.distcp` file per rank (the weights and the optimizer state, each rank its own shards).

Atomic: every rank writes into `.<name>.partial/` beside the target; once all have finished, rank 0 moves the old
checkpoint aside to `.<name>.old/`, renames the new one into place and deletes the old one. A kill -9 while the
shards are written leaves the old checkpoint untouched (and a `.partial` directory, deleted at the next start);
one between the two renames leaves the old checkpoint under `.<name>.old`, which `recover` moves back. Saves
written in the background (background.py) go through the same `.partial` directory and `complete`.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from scaleup.errors import UserError

METADATA = "meta.pt"  # Lightning's name (lightning.fabric.utilities.load._METADATA_FILENAME)
SHARDS_METADATA = ".metadata"  # torch.distributed.checkpoint's: where each tensor lies in which file
PARTIAL, OLD = ".partial", ".old"
TORCH_SAVE_HEADER = b"PK\x03\x04"  # torch.save writes a zip archive: its first local file header


def is_sharded(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / METADATA).is_file()


def beside(path: Path, suffix: str) -> Path:
    return path.parent / f".{path.name}{suffix}"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_sharded(
    path: Path, write: Callable[[Path], None], *, is_global_zero: bool, barrier: Callable[[], None]
) -> None:
    """Call `write(tmp)` on every rank (each writes its shards into `tmp`), then put `tmp` in place of `path`."""
    if is_global_zero:
        prepare(path)
    barrier()
    write(beside(path, PARTIAL))  # torch.distributed.checkpoint fsyncs every shard it writes
    barrier()  # every rank's shards are on disk
    if is_global_zero:
        complete(path)
    barrier()


def prepare(path: Path) -> None:
    """Rank 0 before a save to `path`: its directory exists, and no `.partial` of a killed save is in the way."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove(beside(path, PARTIAL))


def complete(path: Path) -> None:
    """Rank 0 once every rank's files are in `.<name>.partial`: make meta.pt and the directory durable, then put
    the directory in place of `path`."""
    tmp = beside(path, PARTIAL)
    with open(tmp / METADATA, "rb+") as f:  # Lightning's torch.save of meta.pt is not fsynced
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    put_in_place(tmp, path)


def put_in_place(new: Path, path: Path) -> None:
    """Rename `new` to `path`, replacing what is there. A rename replaces a file atomically but not a directory (a
    sharded checkpoint, or a file where one was): then the old one moves aside to `.<name>.old` first."""
    if not new.is_dir() and not path.is_dir():
        os.replace(new, path)
        return
    old = beside(path, OLD)
    recover(path)
    _remove(old)
    if path.exists():
        os.rename(path, old)
    os.rename(new, path)
    _fsync_dir(path.parent)
    _remove(old)


def recover(path: str | Path) -> None:
    """Move back a checkpoint that a kill between the two renames of `save_sharded` left under `.<name>.old`."""
    path = Path(path)
    old = beside(path, OLD)
    if not path.exists() and old.exists():
        with contextlib.suppress(FileNotFoundError):  # another rank moved it back first
            os.rename(old, path)


def remove_interrupted(directory: Path) -> list[Path]:
    """Rank 0 at start: delete `.partial` directories of killed saves, restore or delete `.old` ones."""
    for old in directory.glob(f".*{OLD}"):
        recover(directory / old.name[1 : -len(OLD)])
        if old.exists():
            _remove(old)
    stale = list(directory.glob(f".*{PARTIAL}"))
    for path in stale:
        _remove(path)
    return stale


def check_complete(path: Path) -> None:
    """Every file the checkpoint's metadata refers to is there, whole, with torch.save's data where each entry starts.
    A copy that lost or cut one, or one overwritten with other bytes, is refused in one line before it is read: torch
    would fail inside the load, in a traceback on every rank."""
    from scaleup.compat.dcp import stored_entry_offsets, stored_file_sizes

    fix = "copy the whole directory again, or pass another checkpoint"
    try:
        sizes = stored_file_sizes(path)
    except (OSError, EOFError, pickle.UnpicklingError):
        raise UserError(f"sharded checkpoint {path} has no readable {SHARDS_METADATA}: {fix}") from None
    for name, size in sorted(sizes.items()):
        file = path / name
        if not file.is_file():
            raise UserError(f"sharded checkpoint {path} is incomplete: {name} is missing; {fix}")
        if file.stat().st_size < size:
            raise UserError(
                f"sharded checkpoint {path} is incomplete: {name} is truncated ({file.stat().st_size} of {size} "
                f"bytes); {fix}"
            )
    for name, offsets in sorted(stored_entry_offsets(path).items()):
        with open(path / name, "rb") as f:
            for offset in offsets:
                f.seek(offset)
                if f.read(len(TORCH_SAVE_HEADER)) != TORCH_SAVE_HEADER:
                    raise UserError(
                        f"sharded checkpoint {path} is corrupt: {name} has no torch.save data at byte {offset}, "
                        f"where an entry starts; {fix}"
                    )


def read_sharded(path: str | Path, meta: dict[str, Any], weights: bool = True) -> dict[str, Any]:
    """A sharded checkpoint as the one-file checkpoint a single process writes, read without a process group: its
    `meta` (meta.pt, as read by the caller) with the shards added.

    `state_dict` holds full (unsharded) tensors on the CPU under the module's own names, and `optimizer_states`
    the optimizer state keyed by parameter index, as `torch.optim.Optimizer.state_dict()` gives it. With
    `weights=False`, `state_dict` holds meta tensors of the stored shapes and dtypes (no memory: what a resume
    checks before it starts) and no optimizer state is read.
    """
    from scaleup.compat.dcp import read_distributed_checkpoint, stored_tensor_shapes

    path, checkpoint = Path(path), dict(meta)
    if not weights:
        shapes = stored_tensor_shapes(path, "state_dict")
        checkpoint["state_dict"] = {
            k: torch.empty(size, dtype=dtype, device="meta") for k, (size, dtype) in shapes.items()
        }
        return checkpoint
    stored = read_distributed_checkpoint(path)
    checkpoint["state_dict"] = stored.pop("state_dict")
    optimizers = sorted((key for key in stored if key.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    checkpoint["optimizer_states"] = [by_index(stored[key]) for key in optimizers]
    return checkpoint


def by_index(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (torch.distributed.checkpoint's) keyed by index instead: the
    parameters are numbered in the order of the param groups, as `Optimizer.state_dict()` numbers them.

    An optimizer without state (SGD without momentum) has no `state` entry on disk: torch.distributed.checkpoint
    stores the leaves of a state dict, and an empty dict has none."""
    index: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        ids = [index.setdefault(name, len(index)) for name in group["params"]]
        groups.append({**group, "params": ids})
    per_parameter = state.get("state", {})
    return {"state": {index[name]: value for name, value in per_parameter.items()}, "param_groups": groups}
