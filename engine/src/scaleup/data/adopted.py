"""Any LightningDataModule, fed to N devices the template's way: its datasets, collate functions and worker
settings, with the template's samplers and the plan's per-device batch.

A DataModule written as Lightning's documentation writes one (`setup()` makes the datasets, each
`*_dataloader()` returns a DataLoader with a `batch_size` of its own) trains as it is. The jobs call its
`prepare_data()` (one process at a time per node), then `setup("fit")` and `setup("test")` once, before the Trainer
exists, and take from each loader it returns the dataset, the collate function and the worker settings; the
loaders the Trainer gets are the template's: the global-batch training sampler and unpadded evaluation shards,
at the plan's per-device batch. With no `data.global_batch_size` (nor `data.per_device_batch_size`) the train
loader's own `batch_size` is the global batch: the recipe as it runs on one device, the same on any device count.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import DataLoader, IterableDataset

from scaleup.data.datamodule import GlobalBatchDataModule, iterable_message
from scaleup.errors import UserError

SPLITS = {"train": "train_dataloader", "val": "val_dataloader", "test": "test_dataloader"}
# What the template takes from each of the module's own loaders; the dataset, the sampler and the batch size are
# the template's.
LOADER_SETTINGS = ("collate_fn", "num_workers", "pin_memory", "persistent_workers", "prefetch_factor", "worker_init_fn")


# What the template's own data modules give a net (data/classification.py, the example's text data), read from an
# adopted module that has it as an attribute or a property (lightning-hydra-template's MNIST has `num_classes`).
DATA_GIVEN = ("num_classes", "in_channels", "vocab_size", "block_size")


class AdoptedDataModule(GlobalBatchDataModule):
    """`module`, a LightningDataModule, with the template's loaders. Lightning sees this one; the module's own
    batch hooks (`transfer_batch_to_device`, `on_before_batch_transfer`, `on_after_batch_transfer`) and state
    (`state_dict`) are its own, and any other attribute (a `num_classes` a LightningModule reads through
    `trainer.datamodule`) is read from it; what it knows of the data (`num_classes`, ...) fills the net keys the
    model config leaves null, as the template's own modules' `model_settings()` do."""

    def __init__(self, module: L.LightningDataModule, **loader_kwargs: Any) -> None:
        super().__init__(**loader_kwargs)
        self.module = module
        self.loaders: dict[str, DataLoader] = {}

    def __getattr__(self, name: str) -> Any:
        # Only for what this class lacks: the module's own attributes and properties.
        if name == "module":
            raise AttributeError(name)
        return getattr(self.module, name)

    def prepare_data(self) -> None:
        self.module.prepare_data()

    def model_settings(self) -> dict[str, Any]:
        """The module's own `model_settings()` where it has one, else each of DATA_GIVEN it holds as an integer (read
        after its `setup`), for the net keys the model config leaves null."""
        own = getattr(self.module, "model_settings", None)
        if callable(own):
            return own()
        given = {name: getattr(self.module, name, None) for name in DATA_GIVEN}
        return {f"net.{name}": value for name, value in given.items() if type(value) is int}

    def build_splits(self) -> dict[str, Any]:
        name = type(self.module).__name__
        for stage in ("fit", "test"):
            self.module.setup(stage)
        for split, method in SPLITS.items():
            if not is_overridden(method, self.module, L.LightningDataModule):
                continue  # not defined: the plan names the missing split
            loader = getattr(self.module, method)()
            if not isinstance(loader, DataLoader):
                raise UserError(
                    f"data: {name}.{method}() returns a {type(loader).__name__}, not one DataLoader: the template "
                    "takes one loader per split (several evaluation loaders cannot be counted exactly)"
                )
            if isinstance(loader.dataset, IterableDataset):
                raise UserError(iterable_message(f"the {split} split of {name}", loader.dataset))
            self.loaders[split] = loader
        return {split: loader.dataset for split, loader in self.loaders.items()}

    def recipe_batch_size(self) -> int | None:
        """The module's own train loader's batch size, or None where it has none (a batch sampler of its own)."""
        loader = self.loaders.get("train")
        return None if loader is None else loader.batch_size

    def loader_settings(self, split: str) -> dict[str, Any]:
        loader = self.loaders[split]
        settings = {name: getattr(loader, name) for name in LOADER_SETTINGS}
        if not loader.num_workers:
            settings.update(persistent_workers=False, prefetch_factor=None)  # DataLoader refuses them without workers
        return settings

    def transfer_batch_to_device(self, batch: Any, device: Any, dataloader_idx: int) -> Any:
        return self.module.transfer_batch_to_device(batch, device, dataloader_idx)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return self.module.on_before_batch_transfer(batch, dataloader_idx)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return self.module.on_after_batch_transfer(batch, dataloader_idx)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "datamodule": self.module.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        self.module.load_state_dict(state.pop("datamodule", {}))
        super().load_state_dict(state)

    def teardown(self, stage: str) -> None:
        self.module.teardown(stage)
