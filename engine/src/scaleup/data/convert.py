"""Convert any data set of the template (any `data=` option) into shards: `python -m scaleup.data.convert`.

    python -m scaleup.data.convert data=digits out=DIR [samples_per_shard=1024] [workers=N] [data.KEY=VALUE ...]

workers defaults to min(8, the CPU count). DIR is a local directory: copy it to object storage afterwards. DIR
must be new, empty or an earlier conversion, which is replaced whole (its indexes removed first, so no reader
finds shards of two conversions); a directory holding anything else is refused.

Writes `DIR/<split>/shard-000000.tar ...` and `DIR/<split>/index.json` for each split the data module builds,
then `data=sharded data.url=DIR` trains on them. Shard k of a split holds its samples [k x samples_per_shard,
(k + 1) x samples_per_shard): the same bytes on every run whatever `workers` is, written in parallel, one shard
per task. Images are stored encoded: ImageFolder's files as they are (no re-encoding), other PIL images as PNG;
tensors as .npy, integers as .cls. Convert without augmentation (data.augment=true is refused): the sharded data
module applies its own `train_transform` when it loads a sample, drawn per (seed, epoch, sample).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import multiprocessing
import os
import re
import shutil
import signal
import sys
import zlib
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset, Subset

from scaleup.config.arguments import split_arguments
from scaleup.config.composition import composition_error
from scaleup.config.project import compose_project
from scaleup.data.index import SPLITS
from scaleup.data.shards.format import (
    IMAGE_TYPES,
    UnstorableValue,
    encode_field,
    end_of_archive,
    member_spans,
    sample_bytes,
)
from scaleup.data.shards.index import INDEX, index_document
from scaleup.errors import UserError

CONVERTED = re.compile(r"(\.partial-)?shard-\d{6}\.tar|" + re.escape(INDEX))  # what `convert` writes in a split
OPTIONS = {"out": None, "samples_per_shard": "1024", "workers": str(min(8, os.cpu_count() or 1))}
_SPLITS: dict[str, Dataset] = {}  # inherited by the forked workers: the data set is built once


def raw_sample(dataset: Dataset, index: int) -> list[tuple[str, bytes]]:
    """Sample `index` as stored fields: image files and PIL images encoded, without the split's transform."""
    from PIL import Image
    from torchvision.datasets import DatasetFolder

    from scaleup.data.images import ImageFiles

    while isinstance(dataset, Subset):
        dataset, index = dataset.dataset, int(dataset.indices[index])
    if isinstance(dataset, (DatasetFolder, ImageFiles)):  # image files: their own bytes, no decode and re-encode
        path, target = dataset.samples[index]
        kind = Path(path).suffix.lower().lstrip(".")
        data = Path(path).read_bytes()
        if kind not in IMAGE_TYPES:
            with Image.open(path) as image:
                kind, data = "png", png_bytes(image.convert("RGB"))
        return [encode_field(data, 0, kind), encode_field(int(target), 1)]
    if getattr(dataset, "transform", None) is not None:  # torchvision's convention, also CIFAR-10's augmentation
        transform, dataset.transform = dataset.transform, None  # the stored image, not the training tensor
        try:
            sample = dataset[index]
        finally:
            dataset.transform = transform
    else:
        sample = dataset[index]
    values = sample if isinstance(sample, tuple) else (sample,)
    return [
        encode_field(png_bytes(value), i, "png") if isinstance(value, Image.Image) else encode_field(value, i)
        for i, value in enumerate(values)
    ]


def stored_sample(dataset: Dataset, split: str, index: int) -> list[tuple[str, bytes]]:
    """`raw_sample`, or a UserError naming the sample where a value has no field type (a dict sample)."""
    try:
        return raw_sample(dataset, index)
    except UnstorableValue as err:
        raise UserError(
            f"sample {index} of the {split} split: {err}. A sample is stored as one such value or a tuple "
            "(input, target, ...) of them: return tuples from the datasets you convert"
        ) from None


def png_bytes(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def write_shard(task: tuple[str, int, int, str]) -> dict[str, Any]:
    """Write one shard (split, shard number, samples per shard, directory): its index entry and fields."""
    split, shard, per_shard, directory = task
    dataset = _SPLITS[split]
    first, last = shard * per_shard, min(len(dataset), (shard + 1) * per_shard)
    fields: list[str] | None = None
    name = f"shard-{shard:06d}.tar"
    partial = Path(directory) / f".partial-{name}"
    digest, size, crc32, spans = hashlib.sha256(), 0, [], []
    with open(partial, "wb") as out:
        for index in range(first, last):
            stored = stored_sample(dataset, split, index)
            names = [field for field, _ in stored]
            if fields is not None and names != fields:
                raise UserError(f"sample {index} of {split} has fields {names}, sample {first} {fields}")
            fields = names
            crc32.append([zlib.crc32(data) for _, data in stored])
            spans.append(member_spans(size, [len(data) for _, data in stored]))
            for piece in (sample_bytes(index, stored),) + ((end_of_archive(),) if index == last - 1 else ()):
                out.write(piece)
                digest.update(piece)
                size += len(piece)
    os.replace(partial, Path(directory) / name)
    entry = {"url": name, "nsamples": last - first, "filesize": size, "sha256": digest.hexdigest()}
    entry |= {"crc32": crc32, "spans": spans}
    return {"entry": entry, "fields": fields}


def convert(splits: dict[str, Dataset], out: Path, per_shard: int, workers: int, settings: dict) -> dict[str, str]:
    """Write every split's shards and index under `out`; the checksum of each split's index."""
    _SPLITS.clear()
    _SPLITS.update(splits)
    checksums = {}
    context = multiprocessing.get_context("fork")  # the workers inherit the data set instead of rebuilding it
    # A worker dies on the SIGTERM that ends the pool, whatever handler this process had (a training job's).
    pool = context.Pool(workers, signal.signal, (signal.SIGTERM, signal.SIG_DFL)) if workers > 1 else None
    with pool or contextlib.nullcontext():
        for split, dataset in splits.items():
            if not len(dataset):  # e.g. data.test_size=0: nothing to shard
                continue
            directory = out / split
            directory.mkdir(parents=True, exist_ok=True)
            tasks = [(split, k, per_shard, str(directory)) for k in range(-(-len(dataset) // per_shard))]
            written = pool.map(write_shard, tasks, chunksize=1) if pool else [write_shard(task) for task in tasks]
            print(f"{split}: {len(written)}/{len(tasks)} shards written", flush=True)
            fields = {tuple(w["fields"]) for w in written}
            if len(fields) != 1:
                raise UserError(f"the shards of {split} hold different fields: {sorted(fields)}")
            doc = index_document([w["entry"] for w in written], list(fields.pop()), settings)
            (directory / INDEX).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
            checksums[split] = doc["scaleup"]["checksum"]
    return checksums


def build_source(overrides: list[str]) -> tuple[dict[str, Dataset], dict[str, Any]]:
    """The data module the overrides choose (as `python train.py` would build it, its values checked as train.py
    checks them): its splits and model settings."""
    from omegaconf import OmegaConf

    from scaleup.build import build_datamodule
    from scaleup.config.schema import validate_config
    from scaleup.distributed.run_dir import register_resolvers

    register_resolvers()
    compose_train = functools.partial(compose_project, "train", job_name="convert", hydra=False)
    try:
        cfg = compose_train(overrides)
    except Exception as err:  # a misspelled key or data option: one line naming the closest
        user_error = composition_error(err, compose_train, overrides, extra=OPTIONS, job="train")
        if user_error is None:
            raise
        raise user_error from err
    # train.py's checks of the sections read here (the run's paths resolve only in a run)
    validate_config(OmegaConf.masked_copy(cfg, ["seed", "data", "loader"]))
    if cfg.data.get("augment"):
        raise UserError(
            "data.augment=true would store one random draw of each training sample in the shards, the same every "
            "epoch: convert with data.augment=false, and augment while training (drawn per seed, epoch and sample): "
            "data=sharded data.train_transform={_target_:...}"
        )
    data, loader = (OmegaConf.to_container(section, resolve=True) for section in (cfg.data, cfg.loader))
    datamodule = build_datamodule(data, loader, cfg.seed)
    datamodule.prepare_data()
    return datamodule.build_splits(), datamodule.model_settings()


def positive_int(options: dict[str, Any], key: str) -> int:
    """The option `key` as an integer >= 1, or a UserError naming it."""
    try:
        value = int(options[key])
    except ValueError:
        value = 0
    if value < 1:
        raise UserError(f"{key}={options[key]} must be an integer >= 1")
    return value


def local_out(out: str | None) -> Path:
    """The output directory, which must be local (a URL would become a local directory named like it)."""
    if not out:
        raise UserError("give the output directory: python -m scaleup.data.convert data=<source> out=DIR")
    if "://" in out:
        raise UserError(
            f"out={out}: the converter writes to a local directory; convert to one (out=DIR), then copy DIR to "
            "object storage (e.g. aws s3 cp --recursive DIR s3://...) and train with data.url=s3://..."
        )
    return Path(out)


def earlier_conversion(out: Path) -> list[Path]:
    """The split folders of an earlier conversion in `out` (none when `out` is new or empty); a UserError when `out`
    is not a directory, or holds anything the converter does not write."""
    existing = next(path for path in (out, *out.parents) if path.exists())
    if not existing.is_dir():
        raise UserError(f"out={out}: {existing} is not a directory; choose another out=DIR")
    if existing != out:
        return []
    splits = [path for path in out.iterdir() if path.name in SPLITS and path.is_dir()]
    foreign = [path for path in out.iterdir() if path not in splits]
    foreign += [path for split in splits for path in split.iterdir() if not CONVERTED.fullmatch(path.name)]
    if foreign:
        raise UserError(
            f"out={out} holds {foreign[0]}, which the converter does not write: convert into a new or empty "
            "directory (an earlier conversion there is replaced whole)"
        )
    return splits


def replace(out: Path, earlier: list[Path]) -> None:
    """Remove the earlier conversion in `out`, its indexes first (a reader finds no split rather than shards of
    two conversions), and create `out`."""
    for split in earlier:
        (split / INDEX).unlink(missing_ok=True)
    for split in earlier:
        shutil.rmtree(split)
    if earlier:
        print(f"{out}: the earlier conversion removed", flush=True)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"out={out} cannot be created ({err.strerror}): choose a directory you can write") from None


def main(argv: list[str]) -> int:
    """0: converted, 2: a mistake in the arguments (one line on stderr)."""
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    options, overrides = split_arguments(argv, OPTIONS)
    try:
        out = local_out(options["out"])
        per_shard, workers = positive_int(options, "samples_per_shard"), positive_int(options, "workers")
        earlier = earlier_conversion(out)
        splits, settings = build_source(overrides)
        for split, dataset in splits.items():  # samples the shards cannot hold: refused before `out` is touched
            if len(dataset):
                stored_sample(dataset, split, 0)
        replace(out, earlier)
        checksums = convert(splits, out, per_shard, workers, settings)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for split, checksum in checksums.items():
        print(f"{split}: {len(splits[split])} samples, index checksum {checksum}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
