"""What every data module gets from the engine: fixed disjoint splits, sizes stated without the files and checked
against them, memory pinned for GPUs only, and one message for a split that is missing. (The example project's own
data modules are tested in its tests/.)"""

import lightning as L
import pytest
import torch

from scaleup.data.datamodule import random_split_indices, sizes_for_plan
from scaleup.errors import UserError
from testbed.data import DigitsDataModule, SyntheticDataModule


def test_splits_are_fixed_and_disjoint():
    a, b = DigitsDataModule(global_batch_size=64), DigitsDataModule(global_batch_size=64, seed=7)
    assert a.split_sizes() == b.split_sizes() == {"train": 1257, "val": 180, "test": 360}
    for split in ("train", "val", "test"):  # the run seed does not move samples between splits
        assert torch.equal(a.splits[split].tensors[0], b.splits[split].tensors[0])
    parts = random_split_indices(1797, (1257, 180, 360), seed=0)
    assert sorted(torch.cat(parts).tolist()) == list(range(1797))


def test_stated_sizes_need_no_files_and_fractions_round_as_documented():
    """What a dry run plans with: the sizes a module states (a count, or a fraction of the data set)."""
    assert DigitsDataModule(val_size=0.1, test_size=0.2).known_split_sizes() == {"train": 1258, "val": 180, "test": 359}
    synthetic = SyntheticDataModule(train_size=100, val_size=10, test_size=20, global_batch_size=8)
    assert synthetic.known_split_sizes() == synthetic.split_sizes() == {"train": 100, "val": 10, "test": 20}


def test_stated_sizes_that_disagree_with_the_files_are_refused():
    class Misstated(DigitsDataModule):
        def known_split_sizes(self):
            return {"train": 1000, "val": 180, "test": 360}

    with pytest.raises(UserError, match=r"Misstated.known_split_sizes\(\) says .* but the data holds .*'train': 1257"):
        Misstated(global_batch_size=8).split_sizes()


def test_pinned_memory_is_for_gpus_only():
    """data.pin_memory=auto pins host memory only when the Trainer copies batches to a GPU (tests/test_gpu.py)."""
    dm = SyntheticDataModule(global_batch_size=8, train_size=64, val_size=16, test_size=16, num_workers=0)
    dm.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert not dm.train_dataloader().pin_memory and not dm.test_dataloader().pin_memory
    assert DigitsDataModule(global_batch_size=8, pin_memory=True).train_dataloader().pin_memory  # set, not auto


def test_a_module_with_only_a_test_split_evaluates_but_does_not_train(tmp_path):
    """What eval.py needs is the test split alone; training with only that is refused in one message."""

    class TestOnly(DigitsDataModule):
        def known_split_sizes(self):
            return None

        def build_splits(self):
            return {"test": super().build_splits()["test"]}

    dm = TestOnly(global_batch_size=8)
    dm.setup()
    assert {split: len(ds) for split, ds in dm.splits.items()} == {"test": 360}
    with pytest.raises(UserError, match=r"^TestOnly has no train or val split \(only test\): training needs all three"):
        sizes_for_plan(dm, run_dir=tmp_path, dry_run=False)
