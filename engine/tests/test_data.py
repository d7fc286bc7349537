"""Each DataModule: split sizes, shapes, determinism, and clear errors for missing data."""

import shutil

import lightning as L
import pytest
import torch
from PIL import Image

from myproject.data import CIFAR10DataModule, DigitsDataModule, ImageFolderDataModule, SyntheticDataModule
from scaleup.data.datamodule import random_split_indices, sizes_for_plan
from scaleup.errors import UserError


def test_digits_splits_are_fixed_and_disjoint():
    a, b = DigitsDataModule(global_batch_size=64), DigitsDataModule(global_batch_size=64, seed=7)
    assert a.split_sizes() == b.split_sizes() == {"train": 1257, "val": 180, "test": 360}
    for split in ("train", "val", "test"):  # the run seed does not move samples between splits
        assert torch.equal(a.splits[split].tensors[0], b.splits[split].tensors[0])
    x, y = a.splits["train"][0]
    assert x.shape == (1, 8, 8) and 0 <= int(y) < 10
    parts = random_split_indices(1797, (1257, 180, 360), seed=0)
    assert sorted(torch.cat(parts).tolist()) == list(range(1797))


def test_digits_fractional_sizes():
    assert DigitsDataModule(global_batch_size=8, val_size=0.1, test_size=0.2).split_sizes() == {
        "train": 1258,
        "val": 180,
        "test": 359,
    }


def test_synthetic_is_a_function_of_seed_and_index():
    dm = SyntheticDataModule(global_batch_size=8, train_size=1_281_167, image_shape=(3, 64, 64), num_classes=1000)
    train = dm.split_sizes() and dm.splits["train"]
    assert len(train) == 1_281_167
    x, y = train[1_000_000]
    assert x.shape == (3, 64, 64) and 0 <= y < 1000
    again = SyntheticDataModule(global_batch_size=8, train_size=1_281_167, image_shape=(3, 64, 64), num_classes=1000)
    again.setup()
    assert torch.equal(again.splits["train"][1_000_000][0], x)
    assert not torch.equal(dm.splits["val"][0][0], train[0][0])  # splits use disjoint indices


def test_synthetic_is_learnable():
    """Nearest prototype classifies far above chance: accuracy on it means something."""
    dm = SyntheticDataModule(global_batch_size=8, image_shape=(3, 8, 8), num_classes=10)
    dm.setup()
    val = dm.splits["val"]
    protos = torch.nn.functional.interpolate(val.prototypes, size=(8, 8)).flatten(1)
    correct = sum(int(((protos - val[i][0].flatten()) ** 2).sum(1).argmin() == val[i][1]) for i in range(200))
    assert correct / 200 > 0.9


@pytest.fixture
def image_tree(tmp_path):
    for split, count in (("train", 6), ("val", 3)):
        for label in ("cat", "dog"):
            folder = tmp_path / split / label
            folder.mkdir(parents=True)
            for i in range(count):
                color = (200, 30 * i, 0) if label == "cat" else (0, 30 * i, 200)
                Image.new("RGB", (40, 30), color).save(folder / f"{i}.png")
    return tmp_path


def test_imagefolder_on_generated_pngs(image_tree):
    dm = ImageFolderDataModule(root=str(image_tree), image_size=32, global_batch_size=4, num_workers=0)
    assert dm.num_classes == 2
    assert dm.split_sizes() == {"train": 12, "val": 6, "test": 6}
    x, y = dm.splits["val"][0]
    assert x.shape == (3, 32, 32) and y == 0
    batch = next(iter(dm.train_dataloader()))
    assert batch[0].shape == (4, 3, 32, 32)


def test_imagefolder_missing_directory(tmp_path):
    dm = ImageFolderDataModule(root=str(tmp_path / "nowhere"), global_batch_size=4)  # nothing opened yet
    assert dm.num_classes is None and dm.known_split_sizes() is None
    with pytest.raises(UserError, match=r"no train/ directory under data.root="):
        dm.setup()


def test_stated_sizes_need_no_files(tmp_path):
    """What a dry run plans with: CIFAR-10's sizes from the data set's definition, the others from their config."""
    cifar = CIFAR10DataModule(root=str(tmp_path / "nowhere"), val_size=5000, global_batch_size=8)
    assert cifar.known_split_sizes() == {"train": 45000, "val": 5000, "test": 10000}
    assert not (tmp_path / "nowhere").exists()
    assert DigitsDataModule(val_size=0.1, test_size=0.2).known_split_sizes() == {"train": 1258, "val": 180, "test": 359}
    synthetic = SyntheticDataModule(train_size=100, val_size=10, test_size=20, global_batch_size=8)
    assert synthetic.known_split_sizes() == synthetic.split_sizes() == {"train": 100, "val": 10, "test": 20}


def test_stated_sizes_that_disagree_with_the_files_are_refused():
    class Misstated(DigitsDataModule):
        def known_split_sizes(self):
            return {"train": 1000, "val": 180, "test": 360}

    with pytest.raises(UserError, match=r"Misstated.known_split_sizes\(\) says .* but the data holds .*'train': 1257"):
        Misstated(global_batch_size=8).split_sizes()


def test_imagefolder_class_mismatch(image_tree):
    (image_tree / "val" / "bird").mkdir()
    (image_tree / "val" / "bird" / "x.png").write_bytes((image_tree / "val" / "cat" / "0.png").read_bytes())
    dm = ImageFolderDataModule(root=str(image_tree), image_size=32, global_batch_size=4)
    with pytest.raises(UserError, match="different class directories"):
        dm.setup()


def test_cifar10_missing_files_without_download(tmp_path):
    dm = CIFAR10DataModule(root=str(tmp_path), download=False, global_batch_size=8)
    with pytest.raises(UserError, match=r"CIFAR-10 is not under .*data.download=true"):
        dm.prepare_data()


def test_cifar10_offline_download_gives_one_clear_message(tmp_path, monkeypatch):
    # Point the download at a closed local port: the same failure as a machine with no network, but instant.
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    dm = CIFAR10DataModule(root=str(tmp_path), download=True, global_batch_size=8)
    with pytest.raises(UserError, match=r"could not download CIFAR-10 .* seems offline"):
        dm.prepare_data()


def test_pinned_memory_is_for_gpus_only():
    """data.pin_memory=auto pins host memory only when the Trainer copies batches to a GPU (tests/test_gpu.py)."""
    dm = SyntheticDataModule(global_batch_size=8, train_size=64, val_size=16, test_size=16, num_workers=0)
    dm.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert not dm.train_dataloader().pin_memory and not dm.test_dataloader().pin_memory
    assert DigitsDataModule(global_batch_size=8, pin_memory=True).train_dataloader().pin_memory  # set, not auto


def test_imagefolder_with_only_a_test_split_evaluates_but_does_not_train(image_tree, tmp_path):
    """eval.py +data.root=DIR needs only the test split; training with it is refused in one message."""
    shutil.rmtree(image_tree / "train")
    dm = ImageFolderDataModule(root=str(image_tree), image_size=32, global_batch_size=4, num_workers=0)
    dm.setup()
    assert {split: len(ds) for split, ds in dm.splits.items()} == {"val": 6, "test": 6}
    with pytest.raises(UserError, match=r"ImageFolderDataModule has no train split \(only val, test\)"):
        sizes_for_plan(dm, run_dir=tmp_path, dry_run=False)
