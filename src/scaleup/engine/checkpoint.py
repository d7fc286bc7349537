"""Checkpoints that load anywhere and never execute code: safe loading, prefix repair, atomic writes."""

from __future__ import annotations

import os
import pickle
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from scaleup.engine.errors import UserError

# Prefixes other code adds to parameter names: DDP's wrapper and torch.compile's OptimizedModule.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """`torch.load` with `weights_only=True` on CPU, with one clear message for each way it can fail.

    `weights_only=True` refuses pickles that would import or call anything beyond tensors and plain
    containers, so a crafted file cannot run code here.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist (checkpoints are in <run dir>/checkpoints/)")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if "Unsupported global" in str(err):  # a class or function the file wants imported
            raise UserError(
                f"refused to load {path}: it contains pickled Python objects, not just tensors and plain "
                "containers, and loading it could run arbitrary code. Re-save the weights as a plain "
                "state_dict (only if you trust the file)"
            ) from None
        raise UserError(f"{path} is not a PyTorch checkpoint (it may be truncated or another kind of file)") from None
    except (RuntimeError, EOFError, ValueError) as err:
        raise UserError(f"{path} is not a readable checkpoint: truncated or corrupt ({err})") from None
    if not isinstance(checkpoint, Mapping):
        raise UserError(f"{path} holds a {type(checkpoint).__name__}, not a checkpoint dict or state_dict")
    return dict(checkpoint)


def strip_wrapper_prefixes(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove leading `module.` / `_orig_mod.` (in any order, any depth) from every key."""
    state_dict = dict(state_dict)
    while True:
        before = list(state_dict)
        for prefix in WRAPPER_PREFIXES:
            consume_prefix_in_state_dict_if_present(state_dict, prefix)
        if list(state_dict) == before:
            return state_dict


def load_weights(net: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load a state_dict from anywhere (DDP, torch.compile, plain) into `net`, strictly.

    Raises a UserError listing missing and unexpected keys when it still does not fit.
    """
    result = net.load_state_dict(strip_wrapper_prefixes(state_dict), strict=False)
    if result.missing_keys or result.unexpected_keys:

        def show(keys: list[str]) -> str:
            return ", ".join(keys[:8]) + (f" ... ({len(keys)} in all)" if len(keys) > 8 else "") or "none"

        raise UserError(
            f"the weights do not fit {type(net).__name__}: missing keys: {show(result.missing_keys)}; "
            f"unexpected keys: {show(result.unexpected_keys)}. Was it trained with another model config?"
        )


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """Write to a temporary file beside `path`, fsync, then rename over it.

    A rename within one directory is atomic: a crash leaves either the old file or the new one, never half
    of one. (Lightning's own `_atomic_save` stages the file in $TMPDIR, which is a copy, not a rename, when
    $TMPDIR is on another filesystem.)
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A unique name beside the target; created like any file (umask applies), unlike mkstemp's private 0600.
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "xb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def remove_interrupted_writes(directory: str | Path) -> list[Path]:
    """Delete temporary files that a killed `atomic_torch_save` left behind (never a finished checkpoint)."""
    stale = list(Path(directory).glob(".*.tmp")) if Path(directory).is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


class EpochProgressRepair(Callback):
    """Repairs the epoch counter of checkpoints that Lightning 2.6 writes inconsistently.

    After resuming from a checkpoint saved at the last batch of an epoch, Lightning starts the next epoch without
    counting it as started in `epoch_progress`. A checkpoint saved inside that epoch then looks, on the next
    resume, like the epoch before it, and Lightning trains the whole epoch again (measured: 32 steps instead of
    24 after two such resumes). A checkpoint written inside `on_train_batch_end` always belongs to a started
    epoch: this marks it so before Lightning restores its loops.
    """

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
        batches = fit_loop.get("epoch_loop.batch_progress", {}).get("current", {})
        epochs = fit_loop.get("epoch_progress")
        saved_inside_batch_end = batches.get("completed", 0) < batches.get("ready", 0)
        if epochs and saved_inside_batch_end and epochs["current"]["ready"] == epochs["current"]["completed"]:
            for counts in (epochs["current"], epochs["total"]):
                counts["ready"] = counts["started"] = counts["completed"] + 1


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint IO with same-directory atomic writes and `weights_only=True` reads."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path: str | Path, map_location: Any = None, weights_only: bool | None = None) -> dict:
        return load_checkpoint(path)
