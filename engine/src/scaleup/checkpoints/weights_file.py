"""The weights a new run starts from (`init.weights`): any file of weights a user has, opened without reading its
tensors, each tensor read on its own when it is loaded.

Accepted: a plain state_dict (`torch.save(net.state_dict(), ...)`, this template's export, torchvision's and timm's
published weight files), a safetensors file (the format of the Hugging Face hub and of timm's weights), a checkpoint
that holds one (this template's or another Lightning project's `.ckpt`, timm's training checkpoint, a torchvision
reference script's `{"model": ...}`), this template's sharded checkpoint (a directory), and torchvision's weights by
name (`torchvision:ResNet18_Weights.IMAGENET1K_V1`), read through torchvision's own loader from torch's hub cache.
Every file of torch.save's is read with `weights_only=True`: one that would import or call anything is refused, as a
checkpoint is; a safetensors file holds no pickle at all.

One tensor at a time: a file is memory-mapped (its tensors are read from disk as they are copied, into the page
cache that a node's ranks share; a file of torch.save's is read once whole before, for its CRCs), a sharded
checkpoint reads one entry per call, so a rank that fills its shards from it holds no more than one whole tensor of
its own.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.error import URLError
from urllib.parse import urlparse

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem

from scaleup.checkpoints import sharded
from scaleup.checkpoints.io import exists, find_checkpoint, is_url, read_file
from scaleup.errors import UserError
from scaleup.observability.quiet import quiet_one_process_load

# Where checkpoints keep their state_dict: Lightning and timm ("state_dict"), torchvision's reference scripts
# ("model"), the PyTorch tutorials' ("model_state_dict"), DeepSpeed ("module").
NESTED = ("state_dict", "model", "model_state_dict", "module", "net")
TORCHVISION = "torchvision:"


@dataclass(frozen=True)
class WeightsFile:
    """A file of weights, open: its tensors' names, shapes and dtypes, and `read(name)` for one tensor (full, CPU)."""

    given: str  # init.weights as the user wrote it
    kind: str  # what the file is, in words, for the plan
    shapes: dict[str, tuple[torch.Size, torch.dtype]]
    read: Callable[[str], torch.Tensor]
    bn_batch_size: int | None = None  # samples per BatchNorm statistic in the run that wrote it (this template's)


class MissingWeights(UserError):
    """init.weights names nothing on this machine (a dry run plans without it: the run reads it where it runs)."""


def open_weights(given: str) -> WeightsFile:
    """The weights `init.weights` names: a file, a run directory (its best checkpoint), a sharded checkpoint, or
    `torchvision:<weights>`. Where the file taken is not the one named (a directory, a glob), its kind says which."""
    if given.startswith(TORCHVISION):
        return torchvision_weights(given)
    try:
        path = find_checkpoint(given, prefer="best")
    except UserError as err:  # the same forms as ckpt_path, named as this key
        raise UserError(str(err).replace("ckpt_path=", "init.weights=")) from None
    if not exists(path):
        raise MissingWeights(f"init.weights={given}: no such file or directory")
    if not is_url(path) and sharded.is_sharded(path):
        file = sharded_weights(given, Path(path))
    elif is_safetensors(path):
        file = safetensors_weights(given, path)
    else:
        with torch.serialization.safe_globals([argparse.Namespace]):  # timm stores its arguments: plain values
            loaded = read_file(path, mmap=True)
        state, kind = state_dict_in(loaded, given)
        file = WeightsFile(given, kind, shapes_of(state), state.__getitem__, stored_bn_batch(loaded))
    return file if Path(str(path)) == Path(given) else replace(file, kind=f"{file.kind}, from {path}")


def state_dict_in(loaded: Any, given: str) -> tuple[Mapping[str, torch.Tensor], str]:
    """The state_dict a loaded file holds, and what kind of file it is."""
    if is_state_dict(loaded):
        return loaded, "a state_dict"
    if isinstance(loaded, Mapping):
        for key in NESTED:
            if is_state_dict(loaded.get(key)):
                return loaded[key], f"{checkpoint_kind(loaded)}, its {key}"
        shown = ", ".join(map(str, list(loaded)[:8]))
        raise UserError(
            f"init.weights={given} holds no state_dict: neither tensors by name nor one under "
            f"{', '.join(NESTED)} (its keys: {shown})"
        )
    raise UserError(f"init.weights={given} holds a {type(loaded).__name__}, not a state_dict or a checkpoint")


def is_state_dict(value: Any) -> bool:
    return isinstance(value, Mapping) and bool(value) and all(isinstance(v, torch.Tensor) for v in value.values())


def checkpoint_kind(loaded: Mapping[str, Any]) -> str:
    if "scaleup" in loaded:
        return f"a checkpoint of this template (step {loaded.get('global_step', '?')})"
    if "pytorch-lightning_version" in loaded:
        return "a Lightning checkpoint"
    if "arch" in loaded:
        return f"a timm checkpoint ({loaded['arch']})"
    return "a checkpoint"


def stored_bn_batch(loaded: Any) -> int | None:
    """The BatchNorm batch the plan of this template's run stored in its checkpoint (None: none stored, or no BN)."""
    plan = loaded.get("scaleup", {}).get("plan") if isinstance(loaded, Mapping) else None
    return plan.get("bn_batch_size") if isinstance(plan, Mapping) else None


def shapes_of(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    return {name: (tensor.shape, tensor.dtype) for name, tensor in state.items()}


def is_safetensors(path: str | Path) -> bool:
    """Whether `path` holds the safetensors format: a header size (8 bytes, little-endian) that the file has room for,
    then the header, a JSON object. (A file of torch.save's starts with a zip's or a pickle's bytes.)"""
    filesystem = get_filesystem(path)
    with filesystem.open(str(path), "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:] == b"{" and int.from_bytes(head[:8], "little") + 8 <= filesystem.size(str(path))


def safetensors_weights(given: str, path: str | Path) -> WeightsFile:
    """A safetensors file: its names, shapes and dtypes from its header; a local file memory-mapped, a URL read whole.
    It holds tensors and a header of strings, no pickle: nothing in it can run code. (It has no checksum: a byte
    changed inside a tensor cannot be told from the file, unlike a file of torch.save's.)"""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load

    kind = "a safetensors file"
    try:
        if is_url(path):
            with get_filesystem(path).open(str(path), "rb") as f:
                state = load(f.read())
            return WeightsFile(given, kind, shapes_of(state), state.__getitem__)
        handle = safe_open(str(path), framework="pt")  # its header checked against the file's size: not cut short
    except SafetensorError as err:
        raise UserError(f"{path} is not a readable safetensors file ({err})") from None
    shapes = {
        name: (torch.Size(handle.get_slice(name).get_shape()), stored_dtype(handle, name))
        for name in handle.keys()  # noqa: SIM118 (a safe_open handle cannot be iterated)
    }
    return WeightsFile(given, kind, shapes, handle.get_tensor)


def stored_dtype(handle: Any, name: str) -> torch.dtype:
    """A safetensors tensor's dtype, as torch's, without reading its data: from an empty slice of it (a scalar: read,
    one number)."""
    stored = handle.get_slice(name)
    return (stored[:0] if stored.get_shape() else handle.get_tensor(name)).dtype


def sharded_weights(given: str, path: Path) -> WeightsFile:
    """This template's sharded checkpoint, read entry by entry on this process alone (no process group)."""
    from scaleup.compat.dcp import stored_tensor_shapes

    sharded.check_complete(path)
    meta = read_file(path / sharded.METADATA)
    shapes = stored_tensor_shapes(path, "state_dict")

    def read(name: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        size, dtype = shapes[name]
        tensor = torch.empty(size, dtype=dtype)
        # Only the entry asked for is read; no_dist: no collective, also inside a run whose ranks read their own (and
        # no warning that it assumes so: it is what is meant).
        with quiet_one_process_load():
            dcp.load({"state_dict": {name: tensor}}, checkpoint_id=path, no_dist=True)
        return tensor

    kind = f"a sharded checkpoint of this template (step {meta.get('global_step', '?')})"
    return WeightsFile(given, kind, shapes, read, stored_bn_batch(meta))


def torchvision_weights(given: str) -> WeightsFile:
    """torchvision's published weights by name, through torchvision's own loader: read from torch's hub cache
    ($TORCH_HOME/hub/checkpoints), downloaded there first where it is missing and the machine can reach the URL."""
    from torchvision.models import get_weight

    name = given.removeprefix(TORCHVISION)
    try:
        weights = get_weight(name)
    except (ValueError, KeyError, AttributeError):
        raise UserError(
            f"init.weights={given}: torchvision has no weights {name!r}; name them as <Model>_Weights.<NAME>, "
            "e.g. torchvision:ResNet18_Weights.IMAGENET1K_V1"
        ) from None
    cached = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(weights.url).path)
    try:
        state = weights.get_state_dict(progress=False, weights_only=True)
    except (URLError, OSError) as err:
        raise MissingWeights(
            f"init.weights={given}: {cached} is not there and {weights.url} cannot be fetched ({err}); copy the file "
            "there from a machine that can, or pass its path as init.weights"
        ) from None
    return WeightsFile(given, f"torchvision's weights, from {cached}", shapes_of(state), state.__getitem__)
