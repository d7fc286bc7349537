"""Checkpoints that load anywhere and never execute code: safe loading, prefix repair, atomic writes.

Local paths are written atomically here; URLs (s3://, gs://, memory://, ...) go through fsspec, as Lightning's own
checkpoint IO does. Both are read with `weights_only=True`.
"""

from __future__ import annotations

import glob
import os
import pickle
import uuid
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from scaleup.checkpoints import sharded
from scaleup.errors import UserError
from scaleup.observability.rows import shown

# Prefixes other code adds to parameter names: DDP's wrapper and torch.compile's OptimizedModule.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def is_url(path: str | Path) -> bool:
    """A location with a protocol (s3://, gs://, memory://, file://): read and written through fsspec."""
    return "://" in str(path)


def exists(path: str | Path) -> bool:
    """A checkpoint file, or a sharded checkpoint directory (checkpoints/sharded.py), is there."""
    if is_url(path):
        return get_filesystem(path).isfile(str(path))
    sharded.recover(path)
    return Path(path).is_file() or sharded.is_sharded(path)


def find_checkpoint(path: str | Path, prefer: str = "best") -> str | Path:
    """The checkpoint file the user means by `ckpt_path`.

    - a file or a URL: itself;
    - a glob, e.g. `<run>/checkpoints/best-*.ckpt` (Hydra passes `key=value` to the job unexpanded, so the
      template expands it): its one match;
    - a run directory or its checkpoints/ directory, or `<run>/best` / `<run>/last`: the run's best checkpoint
      (`prefer="best"`, for eval and export; its last.ckpt when it kept no best) or its last.ckpt (`prefer="last"`,
      for resuming).
    """
    text = str(path)
    if is_url(text):
        return text
    if any(char in text for char in "*?["):
        return Path(only_match(text, sorted(glob.glob(text))))
    given = Path(text)
    if given.name in ("best", "last") and not given.exists():
        given, prefer = given.parent, given.name
    if not given.is_dir() or sharded.is_sharded(given):
        return given
    folder = given / "checkpoints" if (given / "checkpoints").is_dir() else given
    patterns = ["best-*.ckpt", "last.ckpt"] if prefer == "best" else ["last.ckpt"]
    for pattern in patterns:
        if matches := sorted(str(p) for p in folder.glob(pattern)):
            return Path(only_match(str(folder / pattern), matches))
    raise UserError(f"ckpt_path={text} is a directory without {' or '.join(patterns)} in {folder}")


def only_match(pattern: str, matches: list[str]) -> str:
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise UserError(f"ckpt_path={pattern} matches no file")
    raise UserError(f"ckpt_path={pattern} matches {len(matches)} files ({', '.join(matches)}): name one of them")


def load_checkpoint(path: str | Path, weights: bool = True) -> dict[str, Any]:
    """`torch.load` with `weights_only=True` on CPU, with one clear message for each way it can fail.

    `weights_only=True` refuses pickles that would import or call anything beyond tensors and plain
    containers, so a crafted file cannot run code here. A sharded checkpoint (a directory) is read as the file
    one process would have written: full tensors; with `weights=False` only the shapes of its weights.
    """
    if not exists(path):
        raise UserError(f"checkpoint {path} does not exist (checkpoints are in <run dir>/checkpoints/)")
    if is_url(path) or not sharded.is_sharded(path):
        checkpoint = read_file(path)
    else:
        sharded.check_complete(Path(path))
        checkpoint = sharded.read_sharded(path, read_file(Path(path) / sharded.METADATA), weights=weights)
    if not isinstance(checkpoint, Mapping):
        raise UserError(f"{path} holds a {type(checkpoint).__name__}, not a checkpoint dict or state_dict")
    return dict(checkpoint)


def read_file(path: str | Path, mmap: bool = False) -> Any:
    """What `torch.save` wrote to `path` (a local file or a URL), read with `weights_only=True` on CPU. A file that
    torch.save did not write, not whole, empty, or (a local file) with a byte changed, is one line. Only torch.load's
    own failures are translated: an error anywhere else is a bug and keeps its traceback.

    `mmap`: a local file in torch.save's zip format is memory-mapped, its tensors read from disk only as they are
    used (other files, and URLs, are read whole); its CRCs are checked all the same."""
    mapped = mmap and not is_url(path) and zipfile.is_zipfile(path)
    with get_filesystem(path).open(str(path), "rb") if is_url(path) else open(path, "rb") as f:
        if not f.read(1):  # torch.load's own error says nothing here: an EOFError without a message
            raise UserError(f"{path} is not a readable checkpoint: the file is empty (0 bytes)")
        f.seek(0)
        try:
            if mapped:
                loaded = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
            else:
                loaded = torch.load(f, map_location="cpu", weights_only=True)
        # torch's weights-only unpickler fails on many text files with a KeyError or an IndexError instead
        except (pickle.UnpicklingError, LookupError) as err:
            if "Unsupported global" in str(err):  # a class or function the file wants imported
                raise UserError(
                    f"refused to load {path}: it contains pickled Python objects, not just tensors and plain "
                    "containers, and loading it could run arbitrary code. Re-save the weights as a plain "
                    "state_dict (only if you trust the file)"
                ) from None
            raise UserError(
                f"{path} is not a PyTorch checkpoint (it may be truncated or another kind of file)"
            ) from None
        # A file cut short: the zip reader fails with a RuntimeError, or (cut within its first ~70 kB) an OSError
        # (EINVAL) from a seek before the file's start.
        except (RuntimeError, EOFError, ValueError, OSError) as err:
            raise UserError(f"{path} is not a readable checkpoint: truncated or corrupt ({err})") from None
    if not is_url(path) and (damaged := damaged_entry(path)) is not None:
        raise UserError(f"{path} is not a readable checkpoint: corrupt ({damaged} fails its CRC-32 check)")
    return loaded


def damaged_entry(path: str | Path) -> str | None:
    """The first entry of the zip torch.save wrote at `path` whose bytes fail their CRC-32, or None (also for a file
    in torch's older, non-zip format). torch.load checks no CRC: a byte changed inside a tensor loads as another
    number. Reading the file (again) for it costs about 0.2 s per 500 MB from the page cache; a memory-mapped file
    read here first is in the page cache when its tensors are copied."""
    if not zipfile.is_zipfile(path):
        return None
    with zipfile.ZipFile(path) as archive:
        return archive.testzip()


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
        raise UserError(
            f"the weights do not fit {type(net).__name__}: missing keys: {shown(result.missing_keys) or 'none'}; "
            f"unexpected keys: {shown(result.unexpected_keys) or 'none'}. Was it trained with another model config?"
        )


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """`torch.save(obj)` to `path`, atomically (`atomic_write`)."""
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def atomic_safetensors_save(state_dict: Mapping[str, torch.Tensor], path: str | Path) -> None:
    """A state_dict as a safetensors file (the format of the Hugging Face hub), atomically (`atomic_write`). The
    format takes no two tensors over the same memory: a tensor tied to one before it (a shared embedding and output
    layer) is written as a copy, so each name loads on its own."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    tensors = {}
    for name, tensor in state_dict.items():
        storage = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.clone() if storage in seen and tensor.numel() else tensor.contiguous()
        seen.add(storage)
    # format=pt: what Hugging Face's loaders look for to read the file as PyTorch weights
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` fills a temporary file beside `path`; it is fsynced, then renamed over `path`.

    A rename within one directory is atomic: a crash leaves either the old file or the new one, never half
    of one. (Lightning's own `_atomic_save` stages the file in $TMPDIR, which is a copy, not a rename, when
    $TMPDIR is on another filesystem.)
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A unique name beside the target; created like any file (umask applies), unlike mkstemp's private 0600, and
    # created here, so that `write` never writes through a file or a link that was there.
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        open(tmp, "xb").close()
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        sharded.put_in_place(tmp, path)  # over a sharded checkpoint (a directory) too
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def remove_interrupted_writes(directory: str | Path) -> list[Path]:
    """Delete temporary files that a killed `atomic_write` left behind (never a finished checkpoint)."""
    if not Path(directory).is_dir():
        return []
    stale = list(Path(directory).glob(".*.tmp"))
    for path in stale:
        path.unlink(missing_ok=True)
    return stale + sharded.remove_interrupted(Path(directory))


def save_checkpoint(obj: Any, path: str | Path) -> None:
    """`atomic_torch_save` for a local path; Lightning's fsspec writer for a URL (object stores have no rename)."""
    if is_url(path):
        TorchCheckpointIO().save_checkpoint(obj, path)
    else:
        atomic_torch_save(obj, path)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint IO with same-directory atomic writes and `weights_only=True` reads.

    URLs keep Lightning's fsspec handling (removal too, inherited); only their reads are made safe here.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        save_checkpoint(checkpoint, path)

    def load_checkpoint(self, path: str | Path, map_location: Any = None, weights_only: bool | None = None) -> dict:
        return load_checkpoint(path)
