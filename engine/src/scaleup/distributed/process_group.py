"""The end of a job's process group: every rank leaves it together."""

from __future__ import annotations


def shut_down_process_group() -> None:
    """Leave the process group together: a rank that exits while a peer still holds gloo connections can
    abort in C++ ("terminate called without an active exception") and fail an otherwise finished run."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
