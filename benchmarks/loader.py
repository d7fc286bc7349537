"""Samples per second that one loader worker delivers, per image pipeline, on the same generated JPEGs, side by side.

Generates N deterministic 500x375 JPEGs (ImageNet's typical size) in an ImageFolder tree, then, alternating the
variants in every repeat, times the training loader of each with `--workers` loader workers (default 1):

- (a) `pil`: the ImageFolder pipeline as it was before this benchmark existed, kept here verbatim: PIL decodes,
  RandomResizedCrop(224) + RandomHorizontalFlip on the PIL image, ToTensor + Normalize in the worker, float32
  batches;
- (b) `map`: `ImageFolderDataModule` as it is: torchvision.io decodes (libjpeg-turbo) into uint8, transforms.v2
  functional on uint8, uint8 batches (normalised on the device after the transfer, not in the worker);
- (c) `shards`: the same JPEGs converted to WebDataset shards (`scaleup.data.convert`, byte for byte, 64 to a
  shard) and streamed from local disk by `ShardedDataModule` (its window shuffle, per-sample seeding, batch 32);
- (d) `library`: webdataset's own loader (`webdataset.WebDataset`, no shuffle) on the same shards, batch 32;
  (c) and (d) decode and transform each sample with the same `ImageTransform` as (b);

with `--remote`, the same shards on a local S3 endpoint (moto's server, engine/tests/s3_server.py) that adds
`--delay-ms` (default 50) to every request, read by sample (`data.reads=samples`):

- (e) `s3_prefetch`: the rank's next steps prefetched to local disk in the background (the default);
- (f) `s3_direct`: no prefetch (`data.prefetch_mb=0`): each micro-batch's byte ranges fetched when asked for;
- (g) `unchecked`: (c) with the per-sample crc32 check switched off, to price the check (also `crc32`, inline:
  the check alone, as a share of `map_inline`'s work per sample);

each reported as a ratio to (c), per repeat, beside the largest wait for one batch;
and, beside them, in this process on one thread: `decode`, torchvision.io's JPEG decode alone (the ceiling of
any pipeline that decodes on this CPU), and `map_inline`, pipeline (b)'s per-sample work without a loader.

Both (a) and (b) go through the template's own loader (`GlobalBatchDataModule.train_dataloader()`: the training
sampler, the per-sample seeding, batch 32); a loader's figure counts the samples after its first batch over the
time from the first batch to the last, so worker start-up is left out. Medians over the repeats, and the ratio
of each to (a), are printed and written to benchmarks/results/loader_cpu.json.

    python benchmarks/loader.py [--images 256] [--repeats 3] [--workers 1] [--remote] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import transforms as T
from torchvision.datasets import ImageFolder
from torchvision.io import decode_jpeg, read_file

from myproject.data import ImageFolderDataModule
from myproject.data.imagefolder import IMAGENET_MEAN, IMAGENET_STD
from scaleup.data.convert import convert
from scaleup.data.images import ImageTransform
from scaleup.data.sharded import ShardedDataModule
from scaleup.data.shards.dataset import ShardSplit

RESULTS = Path(__file__).resolve().parent / "results"
WIDTH, HEIGHT, SIZE, BATCH, CLASSES = 500, 375, 224, 32, 2


def make_jpegs(root: Path, count: int) -> list[Path]:
    """`count` 500x375 JPEGs (quality 90) under root/train/<class>/, the same bytes on every run: smooth random
    colour fields with fine noise, which compress and decode like photographs rather than like flat colour."""
    rng = np.random.default_rng(0)
    paths = []
    for i in range(count):
        path = root / "train" / f"class{i % CLASSES}" / f"{i:05d}.jpg"
        paths.append(path)
        if path.exists():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        coarse = Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).resize((WIDTH, HEIGHT), 3)
        pixels = np.asarray(coarse, dtype=np.int16) + rng.normal(0, 12, (HEIGHT, WIDTH, 3)).astype(np.int16)
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(path, quality=90)
    return paths


class BeforeImageFolder(ImageFolderDataModule):
    """(a): the ImageFolder training split as the template built it before, PIL and ToTensor + Normalize in the
    worker, behind the same loader as (b)."""

    def build_splits(self) -> dict:
        normalize = T.Normalize(IMAGENET_MEAN, IMAGENET_STD)
        train_tf = T.Compose([T.RandomResizedCrop(self.image_size), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
        return {"train": ImageFolder(self.root / "train", train_tf)}


def template_batches(cls: type[ImageFolderDataModule]) -> Callable[[Path, int], Iterable]:
    def batches(root: Path, workers: int) -> Iterable:
        data = cls(root=str(root), image_size=SIZE, global_batch_size=BATCH, num_workers=workers)
        data.persistent_workers = False
        return data.train_dataloader()

    return batches


def make_shards(root: Path, out: Path) -> Path:
    """The generated JPEGs as shards of 64 under `out` (the files' own bytes, no re-encoding)."""
    if not (out / "train" / "index.json").exists():
        convert({"train": ImageFolder(root / "train")}, out, per_shard=64, workers=1, settings={})
    return out


def sharded_batches(shards: Path | str, workers: int, **settings: Any) -> Iterable:
    """(c): the template's sharded stream from local disk, iterated outside a Trainer; (e), (f): from S3."""
    data = ShardedDataModule(
        url=str(shards),
        global_batch_size=BATCH,
        num_workers=workers,
        train_transform=ImageTransform(SIZE, True),
        **settings,
    )
    data.persistent_workers = False
    return data.rank_loader()


def unchecked_batches(shards: Path, workers: int) -> Iterable:
    """(g): (c) without the crc32 of each member compared (the forked workers inherit the switch)."""
    check, ShardSplit.check = ShardSplit.check, lambda *args: None
    try:
        yield from sharded_batches(shards, workers)
    finally:
        ShardSplit.check = check


def remote_loaders(shards: Path, delay_ms: float, cache: Path) -> tuple[dict[str, Callable], Callable[[], None]]:
    """(e) and (f) against a local S3 endpoint holding `shards`, with `delay_ms` added per request, served by a
    process of its own (its CPU is the remote's, not the loader's); and a stop."""
    import s3fs

    server = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve().parents[1] / "tests" / "s3_server.py"), str(delay_ms)],
        stdout=subprocess.PIPE,
        text=True,
    )
    url = server.stdout.readline().strip()
    os.environ.update(
        AWS_ENDPOINT_URL=url,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    s3 = s3fs.S3FileSystem()
    s3.mkdir("bucket")
    s3.put(str(shards), "bucket/shards", recursive=True)
    remote = "s3://bucket/shards"
    loaders = {
        "s3_prefetch": lambda _, workers: sharded_batches(remote, workers, reads="samples", cache_dir=str(cache)),
        "s3_direct": lambda _, workers: sharded_batches(remote, workers, reads="samples", prefetch_mb=0),
    }
    return loaders, server.kill


def library_batches(shards: Path, workers: int) -> Iterable:
    """(d): webdataset's own loader over the same shards, the same decode and transform per sample."""
    import webdataset

    transform = ImageTransform(SIZE, train=True)
    urls = sorted(str(path) for path in (shards / "train").glob("shard-*.tar"))
    stream = webdataset.WebDataset(urls, shardshuffle=False, empty_check=False).map(
        lambda sample: (transform.from_bytes(sample["0.jpg"], sample["__key__"]), int(sample["1.cls"]))
    )
    return DataLoader(stream.batched(BATCH), batch_size=None, num_workers=workers)


def loader_rate(batches: Iterable, waits: list[float] | None = None) -> float:
    """Samples per second from the first batch to the last (the first one's wait includes worker start-up);
    the longest wait for one batch after the first is appended to `waits`."""
    iterator = iter(batches)
    next(iterator)
    start, samples, longest = time.perf_counter(), 0, 0.0
    last = start
    for images, _ in iterator:
        samples += len(images)
        now = time.perf_counter()
        last, longest = now, max(longest, now - last)
    if waits is not None:
        waits.append(longest)
    return samples / (time.perf_counter() - start)


def inline_rate(work: Callable[[torch.Tensor, str], object], encoded: list[tuple[torch.Tensor, str]]) -> float:
    """Samples per second of `work` on each encoded image, in this process, one thread."""
    start = time.perf_counter()
    for data, name in encoded:
        work(data, name)
    return len(encoded) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1], help="loader worker counts to time")
    parser.add_argument("--data", type=Path, help="where the JPEGs go (default: a temporary directory)")
    parser.add_argument("--remote", action="store_true", help="also (e)-(g): the shards on a local S3 endpoint")
    parser.add_argument("--delay-ms", type=float, default=50.0, help="added to every request of the endpoint")
    parser.add_argument("--json", type=Path, default=RESULTS / "loader_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(1)  # what a loader worker gets
    stop = None
    with tempfile.TemporaryDirectory() as tmp:
        root = args.data or Path(tmp)
        paths = make_jpegs(root, args.images)
        encoded = [(read_file(str(path)), str(path)) for path in paths]
        transform = ImageTransform(SIZE, train=True)
        inline = {
            "decode": lambda data, name: decode_jpeg(data),
            "map_inline": transform.from_bytes,
            "crc32": lambda data, name: zlib.crc32(data.numpy()),  # the check each sample's members pass
        }
        shards = make_shards(root, root / "shards")
        loaders = {
            "pil": template_batches(BeforeImageFolder),
            "map": template_batches(ImageFolderDataModule),
            "shards": sharded_batches,
            "library": library_batches,
        }
        if args.remote:
            remote, stop = remote_loaders(shards, args.delay_ms, Path(tmp) / "cache")
            loaders |= {**remote, "unchecked": unchecked_batches}
        runs: dict[str, list[float]] = {}
        waits: dict[str, list[float]] = {}
        for repeat in range(args.repeats):
            for name, work in inline.items():
                runs.setdefault(name, []).append(inline_rate(work, encoded))
            for workers in args.workers:
                for name, batches in loaders.items():
                    source = root if name in ("pil", "map") else shards
                    rate = loader_rate(batches(source, workers), waits.setdefault(f"{name}/{workers}", []))
                    runs.setdefault(f"{name}/{workers}", []).append(rate)
            print(f"repeat {repeat + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in runs.items()), flush=True)
        if stop is not None:
            stop()
    medians = {name: statistics.median(rates) for name, rates in runs.items()}
    # Each repeat's ratio to (a) with as many workers, run next to it: the pairs share the machine's load.
    ratios = {
        name: [rate / base for rate, base in zip(rates, runs[f"pil/{name.split('/')[1]}"], strict=True)]
        for name, rates in runs.items()
        if "/" in name
    }
    print(f"\nsamples/s, median of {args.repeats} (min-max); ratio to (a) pil with as many workers, per repeat")
    for name, rates in runs.items():
        ratio = ""
        if name in ratios:
            ratio = f"  {statistics.median(ratios[name]):.2f}x (a) ({min(ratios[name]):.2f}-{max(ratios[name]):.2f})"
        print(f"  {name:14s} {medians[name]:7.0f}  ({min(rates):.0f}-{max(rates):.0f}){ratio}")
    # (c) against (d), the same shards and work, per repeat.
    against_library = {
        workers: [c / d for c, d in zip(runs[f"shards/{workers}"], runs[f"library/{workers}"], strict=True)]
        for workers in args.workers
    }
    for workers, r in against_library.items():
        spread = f"{min(r):.2f}-{max(r):.2f}"
        print(f"  (c) shards / (d) webdataset, {workers} worker(s): {statistics.median(r):.2f}x ({spread})")
    # (e)-(g) against (c), the same shards and work, per repeat: what the remote and the checksums cost.
    against_local = {
        name: [x / c for x, c in zip(rates, runs[f"shards/{name.split('/')[1]}"], strict=True)]
        for name, rates in runs.items()
        if name.split("/")[0] in ("s3_prefetch", "s3_direct", "unchecked")
    }
    if "crc32" in medians:
        share = medians["map_inline"] / medians["crc32"]
        print(f"  the crc32 check: {share:.1%} of a sample's decode and transform (crc32 {medians['crc32']:.0f}/s)")
    for name, r in against_local.items():
        longest = max(waits[name]) * 1000
        spread = f"{min(r):.2f}-{max(r):.2f}"
        print(
            f"  {name} / (c) shards: {statistics.median(r):.2f}x ({spread}), longest wait for a batch {longest:.0f} ms"
        )
    result = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
            "torch": torch.__version__,
            "torchvision": __import__("torchvision").__version__,
        },
        "settings": {"images": args.images, "size": [WIDTH, HEIGHT], "crop": SIZE, "batch": BATCH, **vars(args)},
        "samples_per_s": runs,
        "median": medians,
        "ratio_to_pil": {name: {"median": statistics.median(r), "per_repeat": r} for name, r in ratios.items()},
        "longest_wait_s": waits,
        "over_local_shards": {
            name: {"median": statistics.median(r), "per_repeat": r} for name, r in against_local.items()
        },
        "shards_over_library": {
            str(workers): {"median": statistics.median(r), "per_repeat": r} for workers, r in against_library.items()
        },
    }
    result["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in result["settings"].items()}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {args.json}")


if __name__ == "__main__":
    main()
