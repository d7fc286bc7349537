"""Reading a torch.distributed.checkpoint directory without a process group: every entry, the stored shapes, the
files and their sizes.
"""

from __future__ import annotations

from typing import Any

import torch


def read_distributed_checkpoint(path: Any) -> dict[str, Any]:
    """Every entry of a torch.distributed.checkpoint directory, as full tensors on the CPU, without a process group.

    torch 2.14.1. Reason: torch rebuilds a state dict from the stored metadata alone only with the private
    `_EmptyStateDictLoadPlanner` and `_load_state_dict` (what its public `format_utils.dcp_to_torch_save` does,
    which writes the result to a file; the public `dcp.load` fills only the keys it is given).
    Canary: test_private_empty_planner_reads_a_distributed_checkpoint_without_a_process_group.
    """
    from torch.distributed.checkpoint import FileSystemReader

    try:
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    except ImportError:  # the public converter, through a file
        return read_through_torch_save(path)

    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


def read_through_torch_save(path: Any) -> dict[str, Any]:
    """`read_distributed_checkpoint` with torch's public `dcp_to_torch_save`, which writes one file to read back."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(path, f"{scratch}/state.pt")
        return torch.load(f"{scratch}/state.pt", map_location="cpu", weights_only=False)


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
