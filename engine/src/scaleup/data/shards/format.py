"""The shard format: WebDataset tar files, written byte for byte the same on every run.

A shard is a plain POSIX (ustar) tar. Sample `i` of a split is the run of consecutive members named
`<i, 12 digits>.<field>`: `000000000123.0.jpg`, `000000000123.1.cls`. The field names say position and type:
`jpg`/`jpeg`/`png`/`webp`/`gif` are encoded images (decoded with `decode_image_bytes`), `npy` a numpy
array (`numpy.save`), `cls` an integer class in ASCII decimal, `txt` UTF-8 text. That is WebDataset's convention,
so `tar tvf`, `webdataset.WebDataset` and `wids` read the same files (docs/sharded-data.md).

Members are written with mtime 0, owner 0 and mode 0644, so the same samples give the same bytes.
The index records where every member's payload lies (`member_spans`), so a reader goes straight to a sample's
bytes: a slice of a local shard, or a byte range of a remote one. An index without them (written before) is
read by walking the 512-byte headers once per shard (`scan`, each header's checksum verified).
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

BLOCK = 512
KEY_DIGITS = 12  # sample keys up to 10^12 per split
# What torchvision.io decodes; the converter stores other image files (BMP, TIFF, PPM) re-encoded as PNG.
IMAGE_TYPES = frozenset({"jpg", "jpeg", "png", "webp", "gif"})


class ShardFormatError(ValueError):
    """A shard whose bytes are not the tar the index describes (the caller names the shard)."""


class UnstorableValue(TypeError):
    """A sample's value that no field type holds (a dict, a float, None): the converter names the sample."""


def member_bytes(name: str, data: bytes) -> bytes:
    """One tar member: header and payload padded to whole blocks, with no time, owner or other varying field."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = len(data), 0, 0o644, 0, 0, "", ""
    header = info.tobuf(format=tarfile.USTAR_FORMAT)
    return header + data + b"\0" * (-len(data) % BLOCK)


def end_of_archive() -> bytes:
    """Two zero blocks end a tar; tarfile pads the archive to 20 blocks, which readers do not need."""
    return b"\0" * (2 * BLOCK)


def encode_field(value: Any, position: int, image_type: str | None = None) -> tuple[str, bytes]:
    """A sample's value at `position` as (field name, bytes). Encoded images arrive as bytes with their type."""
    if image_type is not None:
        return f"{position}.{image_type}", bytes(value)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer, torch.Tensor, np.ndarray, str)):
        raise UnstorableValue(f"cannot store a {type(value).__name__} in a shard (tensors, arrays, ints, text, images)")
    if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_floating_point():
        value = int(value)  # a class label held as a tensor (TensorDataset)
    if isinstance(value, (int, np.integer)):
        return f"{position}.cls", str(int(value)).encode()
    if isinstance(value, str):
        return f"{position}.txt", value.encode()
    array = value.numpy() if isinstance(value, torch.Tensor) else value
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return f"{position}.npy", buffer.getvalue()


def member_spans(start: int, sizes: Sequence[int]) -> list[int]:
    """Where the payloads of a sample's members lie when the sample's tar bytes begin at `start`: offset and size
    of each, flat (`[offset0, size0, offset1, size1, ...]`), as the index records them."""
    spans, position = [], start
    for size in sizes:
        spans += [position + BLOCK, size]
        position += BLOCK + size + (-size % BLOCK)
    return spans


def sample_bytes(index: int, fields: Sequence[tuple[str, bytes]]) -> bytes:
    key = f"{index:0{KEY_DIGITS}d}"
    return b"".join(member_bytes(f"{key}.{field}", data) for field, data in fields)


def _octal(field: bytes) -> int:
    digits = field.rstrip(b"\0 ").strip()
    return int(digits, 8) if digits else 0


def scan(buffer: memoryview, first_key: int, count: int) -> tuple[list[str], np.ndarray]:
    """The field names and, per sample, each field's (offset, size) in the shard: shape (count, fields, 2).

    Checks what makes a shard the one the index describes: every header's checksum, `count` samples whose keys
    count up from `first_key`, and the same fields in every sample.
    """
    members: list[tuple[int, str, int, int]] = []  # (key, field, payload offset, size)
    position, total = 0, len(buffer)
    while position + BLOCK <= total:
        header = bytes(buffer[position : position + BLOCK])
        if header == b"\0" * BLOCK:
            break
        if _octal(header[148:156]) != sum(header[:148]) + 8 * 32 + sum(header[156:]):
            raise ShardFormatError(f"bad tar header checksum at byte {position}")
        name = header[:100].rstrip(b"\0").decode(errors="replace")
        key, _, field = name.partition(".")
        size, data = _octal(header[124:136]), position + BLOCK
        if not key.isdigit() or not field:
            raise ShardFormatError(f"member {name!r} at byte {position} is not <sample index>.<field>")
        if data + size > total:
            raise ShardFormatError(f"member {name!r} at byte {position} runs past the end ({total} bytes)")
        members.append((int(key), field, data, size))
        position = data + size + (-size % BLOCK)
    fields = [field for key, field, _, _ in members if key == first_key]
    keys = [key for key, _, _, _ in members]
    if not fields or len(members) != count * len(fields):
        raise ShardFormatError(f"holds {len(members)} members, not {count} samples of {len(fields) or 'any'} fields")
    if keys != [first_key + i for i in range(count) for _ in fields] or [m[1] for m in members] != fields * count:
        raise ShardFormatError(f"its members are not samples {first_key}..{first_key + count - 1} with fields {fields}")
    return fields, np.asarray([m[2:] for m in members], dtype=np.int64).reshape(count, len(fields), 2)


def decode_image_bytes(data: bytes | memoryview) -> torch.Tensor:
    """An encoded image (JPEG, PNG, WebP, GIF, BMP) as a uint8 tensor (channels, height, width).

    The one place shards turn image bytes into pixels: torchvision.io's decoders (libjpeg-turbo, libpng), no
    PIL. The split's transform (e.g. torchvision.transforms.v2) then works on the uint8 tensor.
    """
    from torchvision.io import decode_image  # torchvision's import takes a while: only for image fields

    return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def decode_field(field: str, data: bytes | memoryview) -> Any:
    """A stored field back as the value it was: tensor (npy, images), int (cls) or str (txt)."""
    kind = field.rsplit(".", 1)[-1].lower()
    if kind == "cls":
        return int(bytes(data))
    if kind == "npy":
        return torch.from_numpy(np.load(io.BytesIO(data), allow_pickle=False))
    if kind in IMAGE_TYPES:
        return decode_image_bytes(data)
    if kind == "txt":
        return bytes(data).decode()
    raise ShardFormatError(f"field {field!r} has a type shards do not store (npy, cls, txt, {', '.join(IMAGE_TYPES)})")
