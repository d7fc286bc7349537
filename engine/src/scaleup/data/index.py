"""Index WebDataset tars as they are, to train on them: `python -m scaleup.data.index DIR [fields=jpg,cls]`.

For tars that `webdataset.ShardWriter` wrote, or that were downloaded: DIR holds one split's `*.tar` files, or
`train/`, `val/` and `test/` folders that each hold a split's. Writes each split's `index.json` beside its tars
and changes nothing else (no re-encoding): the samples of each tar, where each member's payload lies and its
crc32, each tar's sha256, the fields and what the model needs (`net.num_classes` from the largest label, a `.cls`
field such as the converter's `1.cls`; `net.in_channels` from the first image). A setting an earlier index there
recorded and the tars cannot give (the converter's, e.g. a vocabulary size) is kept. Then
`python train.py data=sharded data.url=DIR` trains on them.

A sample is WebDataset's: the consecutive members that share a key (the name up to the first dot after the last
slash, `n01440764_10026.JPEG` -> key `n01440764_10026`, field `JPEG`). `fields` chooses the fields and their
order, the input first (default: every field of the first sample, images and arrays first, then the rest by
name); a sample without them is refused in one line naming it. A copy of DIR on object storage reads the same.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tarfile
import zlib
from pathlib import Path
from typing import Any

from scaleup.data.shards.format import IMAGE_TYPES, ShardFormatError, decode_field
from scaleup.data.shards.index import INDEX, index_document
from scaleup.errors import UserError

SPLITS = ("train", "val", "test")
INPUTS = IMAGE_TYPES | {"npy"}  # what a model takes as its input (the first field)
STORED = INPUTS | {"cls", "txt"}  # what `format.decode_field` reads


def split_key(name: str) -> tuple[str, str]:
    """WebDataset's (key, field) of a member name: the field starts at the first dot after the last slash."""
    folder, _, base = name.rpartition("/")
    stem, dot, field = base.partition(".")
    if not dot or not stem or not field:
        return "", ""
    return (f"{folder}/{stem}" if folder else stem), field


def read_tar(path: Path) -> list[tuple[str, dict[str, tuple[int, int]]]]:
    """The samples of a tar in order: (key, {field: (payload offset, size)})."""
    samples: list[tuple[str, dict[str, tuple[int, int]]]] = []
    try:
        with tarfile.open(path, "r:") as tar:  # plain tars only: members are byte ranges of the file
            for member in tar:
                if not member.isfile():
                    continue
                key, field = split_key(member.name)
                if not key:
                    raise UserError(f"{path}: member {member.name!r} is not <key>.<field>, as WebDataset names them")
                if not samples or samples[-1][0] != key:
                    samples.append((key, {}))
                samples[-1][1][field] = (member.offset_data, member.size)
    except tarfile.ReadError as err:
        raise UserError(f"{path} is not a plain (uncompressed) tar: {err}") from None
    return samples


def kind(field: str) -> str:
    """A field's type, its last extension: `jpg`, `cls` (also `1.cls`, the converter's name for a sample's second
    value)."""
    return field.rsplit(".", 1)[-1].lower()


def default_fields(found: dict[str, Any]) -> list[str]:
    return sorted(found, key=lambda field: (kind(field) not in INPUTS, field))


def input_settings(path: Path, key: str, members: dict[str, tuple[int, int]], field: str, data: bytes) -> dict:
    """`net.in_channels` from the first sample's input: an image's channels, or the first of a 3-d array's."""
    if kind(field) not in INPUTS:
        return {}
    offset, size = members[field]
    try:
        value = decode_field(field, data[offset : offset + size])
    except (ShardFormatError, RuntimeError, ValueError) as err:
        raise UserError(f"sample {key!r} of {path}: its {field} cannot be decoded ({err})") from None
    return {"net.in_channels": int(value.shape[0])} if value.ndim == 3 else {}


def check_fields(path: Path, fields: list[str], first: dict[str, Any]) -> None:
    """A UserError unless `fields` are an input and a target (the label) of types the reader decodes."""
    unknown = [f for f in fields if kind(f) not in STORED]
    if unknown:
        known = [f for f in fields if f not in unknown]
        raise UserError(
            f"field {unknown[0]!r} of {path} has a type the reader does not decode ({', '.join(sorted(STORED))}): "
            f"choose the fields to train on, e.g. fields={','.join(known) if len(known) > 1 else 'jpg,cls'}"
        )
    if len(fields) < 2:
        others = [f for f in default_fields(first) if f not in fields]
        fix = (
            f"e.g. fields={fields[0]},{'cls' if 'cls' in others else others[0]}"
            if others
            else "its samples hold nothing else: store each one's label beside it (<key>.cls)"
        )
        raise UserError(
            f"fields={fields[0]} gives the samples of {path} no target: training needs an input and its target "
            f"(the label); {fix}"
        )


def index_split(directory: Path, chosen: list[str] | None) -> dict[str, Any]:
    """Write `directory/index.json` for its tars; the index document."""
    tars = sorted(directory.glob("*.tar"))
    if not tars:
        raise UserError(f"{directory} holds no .tar files")
    shardlist, fields, settings, classes = [], chosen, {}, -1
    seen: dict[str, int] = {}  # each sample key, and the tar holding it
    for number, path in enumerate(tars):
        samples = read_tar(path)
        if not samples:
            raise UserError(f"{path} holds no samples")
        fields = fields or default_fields(samples[0][1])
        check_fields(path, fields, samples[0][1])
        label = next((field for field in fields[1:] if kind(field) == "cls"), None)
        data = path.read_bytes()
        spans, crc32 = [], []
        for key, members in samples:
            if seen.setdefault(key, number) != number:
                raise UserError(
                    f"sample {key!r} is in both {tars[seen[key]].name} and {path.name} of {directory}: a split holds "
                    "each sample once; remove the tars left there by another conversion or copy, then index again"
                )
            if not set(fields) <= set(members) or (chosen is None and len(members) != len(fields)):
                raise UserError(
                    f"sample {key!r} of {path} has the fields {sorted(members)}, not {fields}: every sample needs "
                    "the same fields (choose them with fields=...)"
                )
            spans.append([value for field in fields for value in members[field]])
            crc32.append([zlib.crc32(data[o : o + n]) for o, n in (members[field] for field in fields)])
            if label is not None:
                offset, size = members[label]
                classes = max(classes, int(data[offset : offset + size]))
        if path == tars[0]:
            settings |= input_settings(path, *samples[0], fields[0], data)
        entry = {"url": path.name, "nsamples": len(samples), "filesize": len(data)}
        shardlist.append(entry | {"sha256": hashlib.sha256(data).hexdigest(), "crc32": crc32, "spans": spans})
    if classes >= 0:
        settings["net.num_classes"] = classes + 1
    doc = index_document(shardlist, fields, earlier_settings(directory) | settings)
    (directory / INDEX).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return doc


def earlier_settings(directory: Path) -> dict[str, Any]:
    """The model settings an index already in `directory` recorded (the converter's, from the data module), or none."""
    try:
        return dict(json.loads((directory / INDEX).read_text())["scaleup"]["model_settings"])
    except (OSError, ValueError, KeyError, TypeError):  # no index there, or not one of ours
        return {}


def main(argv: list[str]) -> int:
    """0: indexed, 2: a mistake in the arguments or the tars (one line on stderr)."""
    if not argv or {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0 if argv else 2
    options = dict(arg.split("=", 1) for arg in argv[1:] if "=" in arg)
    try:
        if unknown := [arg for arg in argv[1:] if arg.split("=", 1)[0] != "fields"]:
            raise UserError(f"unknown argument {unknown[0]!r}: python -m scaleup.data.index DIR [fields=jpg,cls]")
        root = Path(argv[0])
        if not root.is_dir():
            raise UserError(f"{root} is not a local directory of tars (index them there, then copy DIR anywhere)")
        chosen = options["fields"].split(",") if "fields" in options else None
        splits = [root] if any(root.glob("*.tar")) else [root / s for s in SPLITS if (root / s).is_dir()]
        if not splits:
            raise UserError(f"{root} holds no .tar files, and no {'/, '.join(SPLITS)}/ folder with some")
        docs = {directory: index_split(directory, chosen) for directory in splits}
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for directory, doc in docs.items():
        meta = doc["scaleup"]
        print(
            f"{directory}: {meta['samples']} samples of {', '.join(meta['fields'])}, index checksum {meta['checksum']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
