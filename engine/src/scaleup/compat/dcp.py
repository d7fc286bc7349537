"""Reading a torch.distributed.checkpoint directory without a process group: every entry, the stored shapes, the
files and their sizes.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from scaleup.observability.quiet import quiet_one_process_load


def read_distributed_checkpoint(path: Any) -> dict[str, Any]:
    """Every entry of a torch.distributed.checkpoint directory, as full tensors on the CPU, without a process group.

    torch 2.14.1. Reason: the public `dcp.load` fills only the entries it is given; here they are made from the
    stored metadata first (an empty tensor of each stored shape and dtype, a placeholder for each other object, at
    the place `Metadata.planner_data` records), as torch's private `_EmptyStateDictLoadPlanner` does (behind its
    public `format_utils.dcp_to_torch_save`, which writes the result to a file).
    Canary: test_private_empty_planner_reads_a_distributed_checkpoint_without_a_process_group.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(path)
    metadata = reader.read_metadata()
    paths = metadata.planner_data or {}
    state: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            entry = torch.empty(entry.size, dtype=entry.properties.dtype)
        put(state, paths.get(key, (key,)), entry)
    with quiet_one_process_load():
        dcp.load(state, storage_reader=reader, no_dist=True)  # tensors filled in place, other objects replaced
    return state


def put(root: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    """Set `value` at `path` in nested dicts and lists (an int a list index), making the containers on the way."""
    container: Any = root
    for key, after in itertools.pairwise(path):
        empty: Any = [] if isinstance(after, int) else {}
        if isinstance(container, list):
            container.extend([None] * (key + 1 - len(container)))
            container[key] = empty if container[key] is None else container[key]
            container = container[key]
        else:
            container = container.setdefault(key, empty)
    if isinstance(container, list):
        container.extend([None] * (path[-1] + 1 - len(container)))
    container[path[-1]] = value


def stored_tensor_shapes(path: Any, prefix: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """(shape, dtype) of every tensor under `prefix.` in a torch.distributed.checkpoint directory, read from its
    metadata alone (public API: `FileSystemReader.read_metadata`; here for its key format, `<prefix>.<name>`).

    torch 2.14.1. Reason: the flattened key format of the metadata is not documented.
    Canary: test_private_empty_planner_reads_a_distributed_checkpoint_without_a_process_group.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    start = f"{prefix}."
    return {
        key[len(start) :]: (entry.size, entry.properties.dtype)
        for key, entry in metadata.items()
        if key.startswith(start) and isinstance(entry, TensorStorageMetadata)
    }


def stored_file_sizes(path: Any) -> dict[str, int]:
    """The files a torch.distributed.checkpoint directory's metadata refers to, each with its size: the end of the
    last entry stored in it.

    torch 2.14.1. Reason: where each entry lies (`Metadata.storage_data`, `_StorageInfo(relative_path, offset,
    length)`) is FileSystemWriter's own format, not a documented one; where a torch stores it otherwise, no file is
    listed (nothing checked before the load, which still fails on a missing file).
    Canary: test_private_empty_planner_reads_a_distributed_checkpoint_without_a_process_group.
    """
    from torch.distributed.checkpoint import FileSystemReader

    sizes: dict[str, int] = {}
    for stored in FileSystemReader(path).read_metadata().storage_data.values():
        if not all(hasattr(stored, name) for name in ("relative_path", "offset", "length")):
            return {}
        sizes[stored.relative_path] = max(sizes.get(stored.relative_path, 0), stored.offset + stored.length)
    return sizes


def stored_entry_offsets(path: Any) -> dict[str, list[int]]:
    """Where each entry of a torch.distributed.checkpoint directory starts in its file, for the entries stored as
    torch.save wrote them (no storage transform, such as compression, recorded for it): each starts with torch.save's
    zip header, which FileSystemReader hands to `torch.load`.

    torch 2.14.1. Reason: as `stored_file_sizes`, FileSystemWriter's own format (`_StorageInfo.offset`,
    `transform_descriptors`); where a torch stores it otherwise, no entry is listed.
    Canary: test_checkpoint.py::test_a_sharded_checkpoint_overwritten_with_garbage_is_one_line (and every read of a
    sharded checkpoint: one whose entries start otherwise is refused).
    """
    from torch.distributed.checkpoint import FileSystemReader

    offsets: dict[str, list[int]] = {}
    for stored in FileSystemReader(path).read_metadata().storage_data.values():
        if not all(hasattr(stored, name) for name in ("relative_path", "offset")):
            return {}
        if not getattr(stored, "transform_descriptors", None):
            offsets.setdefault(stored.relative_path, []).append(stored.offset)
    return offsets
