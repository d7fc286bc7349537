"""The DataModule every data set here builds on: splits in, loaders with the right samplers out."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from scaleup.engine.errors import UserError
from scaleup.engine.plan import BatchPlan, resolve_batch
from scaleup.engine.samplers import GlobalBatchSampler, UnrepeatedDistributedSampler


class GlobalBatchDataModule(L.LightningDataModule):
    """Subclasses implement `build_splits()` (and `prepare_data()` if files must be fetched).

    Batch sizes are global-first: exactly one of `global_batch_size` and `per_device_batch_size` is set, and
    the per-device size is derived from the Trainer's world size and accumulation when loaders are built.
    """

    num_classes: int
    #: True when the whole data set lives in memory, so loader workers would only add start-up time.
    in_memory: bool = False

    def __init__(
        self,
        global_batch_size: int | None = None,
        per_device_batch_size: int | None = None,
        num_workers: int = 4,
        pin_memory: bool | str = "auto",
        persistent_workers: bool = True,
        prefetch_factor: int | None = 2,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.global_batch_size = global_batch_size
        self.per_device_batch_size = per_device_batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers
        self.prefetch_factor = prefetch_factor
        self.seed = seed
        self.splits: dict[str, Dataset] | None = None

    def build_splits(self) -> dict[str, Dataset]:
        """Return {"train": ..., "val": ..., "test": ...} map-style datasets."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self.splits is None:
            self.splits = self.build_splits()

    def split_sizes(self) -> dict[str, int]:
        self.setup()
        return {name: len(ds) for name, ds in self.splits.items()}

    def _loader(self, split: str, sampler: Any, batch_size: int) -> DataLoader:
        pin = self.pin_memory
        if pin == "auto":  # pinned host memory only helps copies to a GPU
            pin = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        workers = self.num_workers
        return DataLoader(
            self.splits[split],
            batch_size=batch_size,
            sampler=sampler,  # never together with shuffle=True: the sampler owns the order
            num_workers=workers,
            pin_memory=bool(pin),
            persistent_workers=self.persistent_workers and workers > 0,
            prefetch_factor=self.prefetch_factor if workers > 0 else None,
        )

    def _batch_and_rank(self) -> tuple[BatchPlan, int]:
        self.setup()
        trainer = self.trainer
        if trainer is None:  # a loader built outside fit/test, e.g. in a notebook
            return resolve_batch(self.global_batch_size, self.per_device_batch_size, 1, 1), 0
        batch = resolve_batch(
            self.global_batch_size, self.per_device_batch_size, trainer.world_size, trainer.accumulate_grad_batches
        )
        return batch, trainer.global_rank

    def train_dataloader(self) -> DataLoader:
        batch, rank = self._batch_and_rank()
        sampler = GlobalBatchSampler(
            self.splits["train"], batch.global_, num_replicas=batch.world_size, rank=rank, seed=self.seed
        )
        if self.trainer is not None:
            # Resuming from a mid-epoch checkpoint: the loop state is restored before loaders are built, so the
            # optimizer steps already taken in this epoch are known; skip exactly those global batches.
            epoch = self.trainer.current_epoch
            steps_done = self.trainer.global_step - epoch * sampler.steps_per_epoch
            if 0 < steps_done < sampler.steps_per_epoch:
                sampler.resume(epoch, steps_done)
        return self._loader("train", sampler, batch.per_device)

    def _eval_loader(self, split: str) -> DataLoader:
        batch, rank = self._batch_and_rank()
        # No padding: DistributedSampler would repeat samples to even out ranks and bias the metrics.
        sampler = UnrepeatedDistributedSampler(
            self.splits[split], num_replicas=batch.world_size, rank=rank, shuffle=False
        )
        return self._loader(split, sampler, batch.per_device)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")


def split_lengths(total: int, val_size: float, test_size: float) -> tuple[int, int, int]:
    """Train/val/test lengths from sizes given as counts (>= 1) or fractions (< 1)."""

    def count(size: float) -> int:
        return int(size) if size >= 1 else round(size * total)

    val, test = count(val_size), count(test_size)
    train = total - val - test
    if train < 1:
        raise UserError(f"val_size={val_size} and test_size={test_size} leave no training data out of {total}")
    return train, val, test


def random_split_indices(total: int, lengths: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    """A split that is the same on every rank and every run (its own generator, not the global one)."""
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    return list(torch.split(order, list(lengths)))
