"""Sharded data: WebDataset tar shards on local disk or behind any fsspec URL, in the template's order.

- `format`: the tar layout, written deterministically; `decode_field` and `decode_image_bytes` read it back.
- `index`: each split's `index.json` (sizes, per-shard sha256, the shard list's checksum).
- `remote`, `cache`: fsspec reads with bounded retries, and a bounded local cache of whole shards.
- `order`: the shard-aware window shuffle, as a `GlobalBatchSampler`.
- `dataset`: `ShardSplit`, a split as a map-style dataset over its shards.
The DataModule is `scaleup.data.sharded.ShardedDataModule`, the converter `python -m scaleup.data.convert`.
"""
