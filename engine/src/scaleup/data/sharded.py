"""Any data set converted to shards (`python -m scaleup.data.convert`), on local disk or behind an fsspec URL."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from lightning.pytorch.utilities import rank_zero_only
from pydantic import Field
from torch.utils.data import DataLoader, Dataset, default_collate

from scaleup.data.datamodule import GlobalBatchDataModule
from scaleup.data.image_batches import normalized_batch
from scaleup.data.samplers import UnrepeatedDistributedSampler
from scaleup.data.shards.cache import default_cache_dir
from scaleup.data.shards.dataset import ShardSplit
from scaleup.data.shards.index import INDEX, ShardIndex
from scaleup.data.shards.order import ShardWindowSampler
from scaleup.data.shards.prefetch import Prefetcher, unit_steps
from scaleup.data.shards.remote import MissingFile, filesystem, is_local, with_retries
from scaleup.errors import UserError
from scaleup.plan.batch import resolve_batch

SPLITS = ("train", "val", "test")
BUCKETS = ("s3", "s3a", "gs", "gcs")  # URL schemes whose first path component is a bucket
log = logging.getLogger(__name__)


class NoShards(UserError):
    """No split has been converted under the URL."""


class ContiguousEvalSampler(UnrepeatedDistributedSampler):
    """Lightning's unpadded evaluation shares (ranks differ by at most one sample), as contiguous runs: rank r
    evaluates the r-th run of samples, so it opens only the shards that hold them."""

    def __iter__(self) -> Iterator[int]:
        sizes = [len(range(r, self.total_size, self.num_replicas)) for r in range(self.num_replicas)]
        start = sum(sizes[: self.rank])
        return iter(range(start, start + sizes[self.rank]))


class ShardedDataModule(GlobalBatchDataModule):
    """The splits under `url` (`<url>/train/index.json`, `val/`, `test/`), read shard by shard.

    Training order: shards permuted each epoch, samples shuffled within windows of `window_shards` shards
    (`ShardWindowSampler`): the global batches depend only on (seed, epoch, global batch) and the shard list.
    Evaluation: every sample once, each rank a contiguous run. Sizes and what the model needs (classes, channels,
    vocabulary) come from the indexes, so a dry run reads no shard. docs/sharded-data.md has the details.
    """

    def __init__(
        self,
        url: str,
        window_shards: Annotated[int, Field(ge=1)] = 8,
        cache_dir: str | None = None,
        cache_gb: Annotated[float, Field(gt=0)] = 50.0,
        reads: Literal["auto", "samples", "shards"] = "auto",
        prefetch_mb: Annotated[float, Field(ge=0)] = 1024.0,
        train_transform: Any = None,
        eval_transform: Any = None,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        **loader_kwargs,
    ) -> None:
        super().__init__(**loader_kwargs)
        self.url, self.window_shards = url.rstrip("/"), window_shards
        self.cache_dir, self.cache_bytes = cache_dir, int(cache_gb * 2**30)
        self.reads, self.prefetch_bytes = reads, int(prefetch_mb * 2**20)
        self._prefetcher: Prefetcher | None = None
        self.train_transform, self.eval_transform = train_transform, eval_transform
        if (mean is None) != (std is None):
            raise UserError("data.mean and data.std go together: set both (per channel, of pixels in [0, 1]) or none")
        self.mean, self.std = mean, std
        self._indexes: dict[str, ShardIndex] | None = None

    @property
    def indexes(self) -> dict[str, ShardIndex]:
        """The index of every split present under `url` (read once; the shards themselves are not opened)."""
        if self._indexes is None:
            indexes = {}
            for split in SPLITS:
                try:
                    indexes[split] = ShardIndex.load(f"{self.url}/{split}")
                except MissingFile:  # a split that was not converted (eval.py needs only test)
                    continue
            if not indexes:
                raise NoShards(self._no_shards())
            self._indexes = indexes
        return self._indexes

    def _no_shards(self) -> str:
        """Why no split was found under `url`, and how to put one there: a URL is converted locally and copied."""
        missing = f"no {'/, '.join(SPLITS)}/ split with an {INDEX} under data.url={self.url}"
        convert = "python -m scaleup.data.convert data=<source> out="
        if "://" not in self.url:
            return f"{missing}; convert a data set there first: {convert}{self.url}"
        copy = (
            f"convert a data set locally ({convert}DIR), then copy DIR to {self.url} with your storage's tool "
            f"(e.g. aws s3 cp --recursive DIR {self.url})"
        )
        scheme, _, path = self.url.partition("://")
        bucket = path.split("/", 1)[0]
        fs = filesystem(self.url)[0]  # made with its own retries: only the lookup is retried below
        if scheme in BUCKETS and not with_retries(lambda: fs.exists(bucket), self.url):
            return (
                f"data.url={self.url}: the bucket {bucket} does not exist (or these credentials cannot see it); "
                f"check the URL, or create the bucket and {copy}"
            )
        return f"{missing}; {copy}"

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """With `mean` and `std`: the uint8 images normalised on the device, as ImageFolder's are."""
        if self.mean is None:
            return batch
        return normalized_batch(batch, self.mean, self.std, self.trainer, self.channels_last)

    def collate_fn(self, split: str) -> Callable[[list], Any]:
        return functools.partial(same_size_collate, split)

    def draws_random_numbers(self, split: str) -> bool:
        """Only a transform draws: without one, the samples need no seeding."""
        return (self.train_transform if split == "train" else self.eval_transform) is not None

    def known_split_sizes(self) -> dict[str, int] | None:
        """The sizes in the indexes; None without them (a dry run then plans with the steps unknown)."""
        try:
            return {split: len(index) for split, index in self.indexes.items()}
        except NoShards:
            return None

    def model_settings(self) -> dict[str, Any]:
        try:
            return next(iter(self.indexes.values())).model_settings
        except NoShards:  # a dry run before the conversion: an image classifier's settings, unknown
            return {"net.num_classes": None, "net.in_channels": None}

    def read_mode(self, index: ShardIndex) -> str:
        """`reads`, with "auto" decided: by sample for a remote whose index says where the samples lie, whole
        shards for a local directory (read in place) and for an index without spans."""
        if self.reads != "auto":
            if self.reads == "samples" and any(spans is None for spans in index.spans):
                raise UserError(
                    f"data.reads=samples needs the sample spans in {index.url}/{INDEX}, which this index (from an "
                    "older converter) does not hold: convert the data again, or set data.reads=shards"
                )
            return self.reads
        spans = all(spans is not None for spans in index.spans)
        return "samples" if spans and not is_local(filesystem(index.url)[0]) else "shards"

    def build_splits(self) -> dict[str, Dataset]:
        self._check_cache_dir()
        splits = {
            split: ShardSplit(
                index,
                transform=self.train_transform if split == "train" else self.eval_transform,
                uint8_images=self.mean is not None,
                cache_dir=self.cache_dir,
                cache_bytes=self.cache_bytes,
                # A global batch draws from one window, two at its boundary.
                keep_open=self.window_shards + 1 if split == "train" else 2,
                reads=self.read_mode(index),
            )
            for split, index in self.indexes.items()
        }
        train = splits.get("train")
        if train is not None and rank_zero_only.rank == 0:
            if train.reads == "samples":
                ahead = "its next steps prefetched to local disk" if self.prefetch_bytes else "no prefetch"
                log.info(
                    f"data.reads=samples: each rank fetches only its own samples of {self.url}, by byte range, "
                    f"{ahead} (data.prefetch_mb={self.prefetch_bytes / 2**20:g})"
                )
            else:
                log.info(f"data.reads=shards: whole shards of {self.url}, {self._where_shards(train)}")
                if why := train.cache.too_small():
                    log.warning(why)
        return splits

    def _check_cache_dir(self) -> None:
        """A remote's shards and prefetched samples go to `cache_dir`: create it here, before any loader worker
        would meet a path it cannot write."""
        if is_local(filesystem(self.url)[0]):
            return
        cache_dir = self.cache_dir or default_cache_dir()
        try:
            Path(cache_dir).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UserError(
                f"data.cache_dir={cache_dir} cannot be created ({err.strerror}): set it to a directory on local "
                "disk that you can write"
            ) from None

    def _where_shards(self, split: ShardSplit) -> str:
        if split.cache.local:
            return "read in place"
        return f"copied once per node into the cache {split.cache.cache_root} (data.cache_gb)"

    def train_sampler(self, global_batch_size: int, world_size: int, rank: int) -> ShardWindowSampler:
        index, split = self.indexes["train"], self.splits["train"]
        prefetch = None
        if split.reads == "samples" and self.prefetch_bytes:
            if self._prefetcher is None:  # one per process: the loader's workers read its spool
                self._prefetcher = Prefetcher(index, Path(self.cache_dir or default_cache_dir()) / "prefetch")
                split.spool = self._prefetcher.directory
            prefetch = (self._prefetcher, unit_steps(self.prefetch_bytes, index, global_batch_size // world_size))
        return ShardWindowSampler(
            split,
            global_batch_size,
            num_replicas=world_size,
            rank=rank,
            seed=self.seed,
            counts=index.counts,
            window=self.window_shards,
            checksum=index.checksum,
            with_epoch=self._seeded("train"),
            prefetch=prefetch,
        )

    def train_dataloader(self):
        self.check_same_shards_on_every_rank()
        return super().train_dataloader()

    def check_same_shards_on_every_rank(self) -> None:
        """Ranks that started at different times may have read different indexes (the shards were rewritten in
        between): compare every rank's checksum with rank 0's, and stop all of them together."""
        trainer = self.trainer
        if trainer is None or trainer.world_size == 1:
            return
        mine = self.indexes["train"].checksum
        same = trainer.strategy.reduce_boolean_decision(trainer.strategy.broadcast(mine, src=0) == mine, all=True)
        if not same:
            raise UserError(
                f"the ranks read different shard sets under {self.url} (this rank's index checksum {mine[:12]}): "
                "the shards changed while the job started; wait until they are written, then start again"
            )

    def rank_loader(
        self, world_size: int = 1, rank: int = 0, *, epoch: int = 0, accumulation: int = 1, split: str = "train"
    ) -> DataLoader:
        """The loader that rank `rank` of `world_size` gets in epoch `epoch`, without a Trainer (benchmarks, tests,
        notebooks): its micro-batches in training order (or its evaluation share, for `split="val"`/`"test"`)."""
        self.setup()
        batch = resolve_batch(self.global_batch_size, self.per_device_batch_size, world_size, accumulation)
        if split != "train":
            return self._loader(split, self.eval_sampler(split, world_size, rank), batch.per_device)
        sampler = self.train_sampler(batch.global_, world_size, rank)
        sampler.set_epoch(epoch)
        return self._loader(split, sampler, batch.per_device)

    def eval_sampler(self, split: str, world_size: int, rank: int) -> ContiguousEvalSampler:
        return ContiguousEvalSampler(self.splits[split], num_replicas=world_size, rank=rank, shuffle=False)


def same_size_collate(split: str, samples: list) -> Any:
    """torch's default_collate; samples of different sizes (images of an ImageFolder stored as they are) end in
    one UserError naming the sizes and the transform that would make them one, not torch.stack's traceback."""
    try:
        return default_collate(samples)
    except RuntimeError:
        shapes = sorted(
            {tuple(getattr(sample[0] if isinstance(sample, tuple) else sample, "shape", ())) for sample in samples}
        )
        if len(shapes) < 2:
            raise
        key = "data.train_transform" if split == "train" else "data.eval_transform"
        raise UserError(
            f"the {split} samples of data.url have different sizes ({', '.join(map(str, shapes[:4]))}) and cannot "
            f"form a batch: set {key} to a transform that resizes them to one size, e.g. "
            f"{key}={{_target_:torchvision.transforms.v2.Resize,size:[32,32]}}"
        ) from None
