"""A split's shard index: `index.json` beside its shards, the sizes a dry run plans from and the checksum that
tells whether the shard set changed.

The file is a wids shard index (`"__kind__": "wids-shard-index-v1"`, a `shardlist` of `{url, nsamples,
filesize}`), so webdataset's own indexed reader opens it too, plus per shard the sha256 of its bytes, the crc32
of every sample's members (`crc32`: one list per sample, one number per field; an index written before them has
none, and its samples are read unchecked) and where each member's payload lies (`spans`: per sample, offset and
size of each field, flat; without them a reader walks the shard's tar headers), and under
`scaleup` the fields of every sample, what the data tells the model (`model_settings`) and `checksum`: the sha256
of the shard list, which changes whenever a shard is added, removed, reordered or rewritten.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from scaleup.data.shards.remote import filesystem, with_retries
from scaleup.errors import UserError

INDEX = "index.json"
FORMAT = "scaleup-shards-v1"


def shard_list_checksum(shardlist: list[dict[str, Any]]) -> str:
    """sha256 of the shard list in canonical JSON: names, counts, sizes and content hashes, in order."""
    return hashlib.sha256(json.dumps(shardlist, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def index_document(shardlist: list[dict[str, Any]], fields: list[str], model_settings: dict[str, Any]) -> dict:
    return {
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "shardlist": shardlist,
        "scaleup": {
            "format": FORMAT,
            "fields": fields,
            "model_settings": model_settings,
            "samples": sum(shard["nsamples"] for shard in shardlist),
            "checksum": shard_list_checksum(shardlist),
        },
    }


def per_member(shard: dict[str, Any], key: str, shape: tuple[int, ...], dtype: type) -> np.ndarray | None:
    """A shard entry's per-sample, per-member list `key` (crc32, spans) as an array of `shape` after the sample
    count; None when the entry has none (an older index)."""
    if key not in shard:
        return None
    values = np.array(shard[key], dtype=dtype).reshape(-1, *shape)
    if len(values) != shard["nsamples"]:
        raise ValueError(f"{shard['url']}: {key} for {len(values)} samples, not {shard['nsamples']}")
    return values


@dataclass(frozen=True)
class ShardIndex:
    """One split's shards: where they are, how many samples each holds, and the checksum of the list."""

    url: str  # the directory of index.json and the shards
    names: tuple[str, ...]
    counts: np.ndarray  # samples per shard, int64
    sizes: tuple[int, ...]  # bytes per shard
    sha256: tuple[str, ...]
    crc32: tuple[np.ndarray | None, ...]  # per shard: (samples, fields) uint32, or None (an older index)
    spans: tuple[np.ndarray | None, ...]  # per shard: (samples, fields, 2) offset and size, int64, or None
    fields: tuple[str, ...]
    model_settings: dict[str, Any]
    checksum: str

    @functools.cached_property
    def ends(self) -> np.ndarray:
        """The split index one past each shard's last sample."""
        return np.cumsum(self.counts)

    @property
    def starts(self) -> np.ndarray:
        """The split index of each shard's first sample."""
        return (self.ends - self.counts).astype(np.int64)

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The shard of each of these split indices, and each one's place in its shard."""
        shards = np.searchsorted(self.ends, samples, side="right")
        return shards, samples - (self.ends[shards] - self.counts[shards])

    def __len__(self) -> int:
        return int(self.counts.sum())

    def shard_url(self, shard: int) -> str:
        return f"{self.url}/{self.names[shard]}"

    @classmethod
    def load(cls, url: str) -> ShardIndex:
        """Read `<url>/index.json` (a local directory or any fsspec URL): the shards' data is not touched."""
        url = url.rstrip("/")
        fs, path = filesystem(url)
        where = f"{url}/{INDEX}"
        text = with_retries(lambda: fs.cat_file(f"{path}/{INDEX}"), where)
        try:
            doc = json.loads(text)
            meta, shardlist = doc["scaleup"], doc["shardlist"]
            if meta["format"] != FORMAT:
                raise KeyError(f"format {meta['format']!r}")
            checksum = shard_list_checksum(shardlist)
            names = tuple(shard["url"] for shard in shardlist)
            counts = np.array([shard["nsamples"] for shard in shardlist], dtype=np.int64)
            fields = len(meta["fields"])
            crc32 = tuple(per_member(shard, "crc32", (fields,), np.uint32) for shard in shardlist)
            spans = tuple(per_member(shard, "spans", (fields, 2), np.int64) for shard in shardlist)
        except (ValueError, KeyError, TypeError) as err:
            raise UserError(
                f"{where} is not a scaleup shard index ({type(err).__name__}: {err}); write one with "
                "python -m scaleup.data.convert data=<source> out=DIR"
            ) from None
        if checksum != meta["checksum"]:
            raise UserError(
                f"{where}: its shard list does not match its checksum ({checksum[:12]} vs {meta['checksum'][:12]}): "
                "the index was edited by hand or only partly written; convert the data again"
            )
        if not len(names) or counts.min() < 1:
            raise UserError(f"{where} lists no shards, or a shard without samples")
        return cls(
            url=url,
            names=names,
            counts=counts,
            sizes=tuple(int(shard["filesize"]) for shard in shardlist),
            sha256=tuple(shard["sha256"] for shard in shardlist),
            crc32=crc32,
            spans=spans,
            fields=tuple(meta["fields"]),
            model_settings=dict(meta.get("model_settings") or {}),
            checksum=checksum,
        )
