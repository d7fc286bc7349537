"""The DataModule every data set here builds on: splits in, loaders with the right samplers out."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from filelock import FileLock
from torch.utils.data import DataLoader, Dataset, IterableDataset

from scaleup.conf import group_values
from scaleup.config.plain import lookup
from scaleup.data.samplers import GlobalBatchSampler, UnrepeatedDistributedSampler, resumed_steps
from scaleup.data.seeding import SeededSamples
from scaleup.distributed.run_dir import run_id
from scaleup.errors import UserError
from scaleup.plan.batch import BatchPlan, resolve_batch
from scaleup.plan.progress import steps_done

log = logging.getLogger(__name__)

# The DataLoader settings every data module shares: the `loader` group's, which a run passes in (build_datamodule);
# a data module built without Hydra (a notebook, a test) gets the same, stated once, in conf/loader/default.yaml.
LOADER = group_values("loader/default")


class GlobalBatchDataModule(L.LightningDataModule):
    """The DataModule the jobs accept: a subclass says what the data is, this class how it is fed to N devices.

    A subclass implements `build_splits()` and passes `**loader_kwargs` to `__init__`; what it must and may
    provide is the DataModule part of docs/contract.md. This class gives the plan its split sizes
    (`split_sizes()`), and the Trainer the loaders: the training sampler that makes the global batches of an
    epoch depend only on (seed, epoch, global batch), whatever the device count, and unpadded evaluation shards
    that count every sample once. Batch sizes are global-first: exactly one of `global_batch_size` and
    `per_device_batch_size` is set, and the per-device size is derived from the Trainer's world size and
    accumulation when loaders are built. Every map-style split is loaded through `SeededSamples`: random
    augmentation drawn from torch's, numpy's or python's global generator in a split's `__getitem__` is seeded
    by (seed, epoch, sample index), the same in any rank and loader worker (docs/randomness.md).

    A run passes every argument from its config: the data option's keys, the `loader` group's and the run's seed.
    The defaults are for a module built without Hydra (a notebook, a test): no batch size (set one), the `loader`
    group's settings (`LOADER`), 4 workers (each data option states its own `num_workers`) and seed 0.
    """

    #: True when the whole data set lives in memory, so loader workers would only add start-up time.
    in_memory: bool = False
    #: The plan's `channels_last` (StepPlan sets it in every process): image batches are then laid out
    #: NHWC, as the weights are.
    channels_last: bool = False

    def __init__(
        self,
        global_batch_size: int | None = None,
        per_device_batch_size: int | None = None,
        max_per_device_batch_size: int | str | None = None,
        num_workers: int = 4,
        pin_memory: bool | str = LOADER["pin_memory"],
        persistent_workers: bool = LOADER["persistent_workers"],
        prefetch_factor: int | None = LOADER["prefetch_factor"],
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.global_batch_size = global_batch_size
        self.per_device_batch_size = per_device_batch_size
        # max_per_device_batch_size is taken so that the data config instantiates: the plan reads it from the
        # config and settles the accumulation, and the loaders follow the Trainer's accumulation.
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers
        self.prefetch_factor = prefetch_factor
        self.seed = seed
        self.splits: dict[str, Dataset] | None = None
        # The training order, saved with every checkpoint (state_dict) and read back on resume (load_state_dict).
        self._order: dict[str, Any] = {}
        self._restored_order: dict[str, Any] | None = None

    def build_splits(self) -> dict[str, Dataset]:
        """Return {"train": ..., "val": ..., "test": ...} map-style datasets."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self.splits is None:
            self.splits = self.build_splits()
            for split, dataset in self.splits.items():
                if isinstance(dataset, IterableDataset):
                    raise UserError(iterable_message(f"the {split} split of {type(self).__name__}", dataset))

    def model_settings(self) -> dict[str, Any]:
        """Settings only the data knows, for the model: dotted keys under `model`, e.g. `{"net.num_classes": 10}`.

        The training job writes each one into the model config where that key is `null`; a value the user set
        stays, and a model config without the key is left alone.
        """
        return {}

    def draws_random_numbers(self, split: str) -> bool:
        """Whether the split's `__getitem__` draws random numbers (augmentation): then each sample is loaded with
        the generators seeded from (seed, epoch, index). Say False for a split that draws none, to save the
        seeding (about 10 us a sample, on the loading path of every step)."""
        return True

    def known_split_sizes(self) -> dict[str, int] | None:
        """The split sizes stated without opening any file, or None when only the files can tell."""
        return None

    def split_sizes(self) -> dict[str, int]:
        """The sizes of the splits `setup()` builds (after `prepare_data()`: the files must be there)."""
        self.setup()
        sizes = {name: len(ds) for name, ds in self.splits.items()}
        known = self.known_split_sizes()
        if known is not None and known != sizes:
            raise UserError(
                f"{type(self).__name__}.known_split_sizes() says {known} but the data holds {sizes}: a dry run "
                "would plan the wrong steps. Check the files under the data root, or correct known_split_sizes()"
            )
        return sizes

    def collate_fn(self, split: str) -> Callable[[list], Any] | None:
        """How the loaders of `split` make a batch of samples; None: torch's default_collate (stacks tensors)."""
        return None

    def loader_settings(self, split: str) -> dict[str, Any]:
        """The DataLoader arguments of `split` besides its dataset, sampler and batch size."""
        pin = self.pin_memory
        if pin == "auto":  # pinned host memory only helps copies to a GPU
            pin = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        workers = self.num_workers
        return {
            "num_workers": workers,
            "pin_memory": bool(pin),
            "persistent_workers": self.persistent_workers and workers > 0,
            "prefetch_factor": self.prefetch_factor if workers > 0 else None,
            "collate_fn": self.collate_fn(split),
        }

    def _loader(self, split: str, sampler: Any, batch_size: int) -> DataLoader:
        dataset = self.splits[split]
        if self._seeded(split):
            # Augmentation seeded by (seed, epoch, index), not by the rank or worker that loads the sample.
            dataset = SeededSamples(dataset, self.seed)
        # Never shuffle=True together with the sampler: the sampler owns the order.
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, **self.loader_settings(split))

    def _seeded(self, split: str) -> bool:
        return self.draws_random_numbers(split)

    def _batch_and_rank(self) -> tuple[BatchPlan, int]:
        self.setup()
        trainer = self.trainer
        if trainer is None:  # a loader built outside fit/test, e.g. in a notebook
            return resolve_batch(self.global_batch_size, self.per_device_batch_size, 1, 1), 0
        # The Trainer's accumulation is the plan's (build_trainer), or the one data.max_per_device_batch_size=auto
        # settled at the start of fit, before any loader is built (AutoBatchSize): the split the plan made.
        batch = resolve_batch(
            self.global_batch_size, self.per_device_batch_size, trainer.world_size, trainer.accumulate_grad_batches
        )
        return batch, trainer.global_rank

    def train_sampler(self, global_batch_size: int, world_size: int, rank: int) -> GlobalBatchSampler:
        """The training order of this rank: the global batches of an epoch, cut into per-rank slices."""
        return GlobalBatchSampler(
            self.splits["train"],
            global_batch_size,
            num_replicas=world_size,
            rank=rank,
            seed=self.seed,
            with_epoch=self._seeded("train"),  # for SeededSamples: each sample's augmentation is keyed by its epoch
        )

    def train_dataloader(self) -> DataLoader:
        batch, rank = self._batch_and_rank()
        sampler = self.train_sampler(batch.global_, batch.world_size, rank)
        self._order = {"sampler": sampler.ORDER, "global_batch_size": batch.global_}
        if self.trainer is not None:
            # Lightning sets the epoch only after it has created the loader's iterator, whose workers start
            # drawing indices at once: a resumed run would read epoch 0's order with loader workers.
            sampler.set_epoch(self.trainer.current_epoch)
        if self.trainer is not None and self.trainer.ckpt_path is not None:
            # Resuming: the loop state is restored before loaders are built, so the plan's steps already taken
            # in this epoch are known; skip exactly those global batches.
            epoch = self.trainer.current_epoch
            skipped = resumed_steps(
                self._restored_order, str(self.trainer.ckpt_path), epoch, steps_done(self.trainer), sampler
            )
            if skipped:
                sampler.resume(epoch, skipped)
        return self._loader("train", sampler, batch.per_device)

    def state_dict(self) -> dict[str, Any]:
        """Saved by Lightning in every checkpoint: which sampler and global batch set the order of the epochs."""
        return dict(self._order)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Called by Lightning on resume, before the loaders are built; absent from checkpoints that predate it."""
        self._restored_order = dict(state_dict)

    def _eval_loader(self, split: str) -> DataLoader:
        batch, rank = self._batch_and_rank()
        return self._loader(split, self.eval_sampler(split, batch.world_size, rank), batch.per_device)

    def eval_sampler(self, split: str, world_size: int, rank: int) -> UnrepeatedDistributedSampler:
        """This rank's share of an evaluation split: every sample on exactly one rank."""
        # No padding: DistributedSampler would repeat samples to even out ranks and bias the metrics.
        return UnrepeatedDistributedSampler(self.splits[split], num_replicas=world_size, rank=rank, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")


def iterable_message(where: str, dataset: Any) -> str:
    """Why a stream is refused: no sampler can split it into per-rank slices of global batches."""
    return (
        f"data: {where} is an IterableDataset ({type(dataset).__name__}): the template splits each global batch "
        "between ranks by index, which a stream does not offer, so every rank would read all of it. Use map-style "
        "datasets (__getitem__ and __len__), or write the data as shards (`python -m scaleup.data.convert`, then "
        "data=sharded: docs/sharded-data.md)"
    )


def apply_model_settings(model_cfg: dict[str, Any], settings: dict[str, Any]) -> None:
    """Write each of a DataModule's `model_settings()` into the plain model config, where its key holds None."""
    for key, value in settings.items():
        parent, _, leaf = key.rpartition(".")
        node = lookup(model_cfg, parent)
        if isinstance(node, dict) and leaf in node and node[leaf] is None:
            node[leaf] = value


def sizes_for_plan(datamodule: GlobalBatchDataModule, *, run_dir: Path, dry_run: bool) -> dict[str, int]:
    """The split sizes the plan is made from: prepare the data (download), set it up, count.

    Every process does this before any process group exists. Under Lightning's own launcher the first process
    does it before it starts the others, which then find the files; torchrun and srun start all processes at
    once, so they take turns under a lock file per node and run directory: the first downloads, the others
    find the files. A dry run prepares nothing and needs no data: it takes the sizes the module states, else
    counts data already in place, else returns {} (the plan then shows the steps as unknown).
    """
    if dry_run:
        known = datamodule.known_split_sizes()
        if known is not None:
            return known
        try:
            return datamodule.split_sizes()
        except UserError as err:
            log.info(f"split sizes unknown until the data is there ({err})")
            return {}
    with FileLock(Path(tempfile.gettempdir()) / f"scaleup-prepare-data-{run_id(run_dir)}.lock"):
        datamodule.prepare_data()
    sizes = datamodule.split_sizes()
    if missing := [split for split in ("train", "val", "test") if split not in sizes]:
        raise UserError(
            f"{type(datamodule).__name__} has no {' or '.join(missing)} split (only {', '.join(sizes) or 'none'}): "
            "training needs all three; check the data settings, e.g. data.root"
        )
    return sizes


def split_lengths(total: int, val_size: float, test_size: float) -> tuple[int, int, int]:
    """Train/val/test lengths from sizes given as counts (>= 1) or fractions (< 1)."""

    def count(size: float) -> int:
        return int(size) if size >= 1 else round(size * total)

    for name, size in (("val_size", val_size), ("test_size", test_size)):
        if size < 0:
            raise UserError(f"{name}={size} must be >= 0: a count (>= 1), or a fraction (< 1) of {total}")
    val, test = count(val_size), count(test_size)
    train = total - val - test
    if train < 1:
        raise UserError(f"val_size={val_size} and test_size={test_size} leave no training data out of {total}")
    return train, val, test


def random_split_indices(total: int, lengths: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    """A split that is the same on every rank and every run (its own generator, not the global one)."""
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    return list(torch.split(order, list(lengths)))
