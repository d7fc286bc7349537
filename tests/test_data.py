"""The example's data modules: split sizes, shapes, determinism, downloads (served from a local HTTP server, through
torchvision's own download code), and one clear message for missing data. Replace them with tests of your own
data modules as you make the project yours."""

import functools
import json
import pickle
import shutil
import tarfile
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from torchvision import transforms as T
from torchvision.datasets import CIFAR10
from torchvision.datasets.utils import calculate_md5

from myproject.data import CIFAR10DataModule, DigitsDataModule, ImageFolderDataModule, SyntheticDataModule
from myproject.data.cifar10 import MEAN, STD, UInt8Images
from scaleup.api import UserError, random_split_indices
from scaleup.testing import QUICK as SHORT
from scaleup.testing import run_job

PROJECT = Path(__file__).resolve().parents[1]  # the folder of train.py and configs/
QUICK = [*SHORT, "trainer.max_epochs=1", "model.net.width=4"]  # one epoch of a narrow network, on the CPU


def test_a_task_of_some_digits_relabels_them_and_keeps_few_training_images():
    """The fine-tuning example's target task (configs/experiment/finetune_digits.yaml): digits 6-9 as classes 0-3,
    5 training images of each; validation and test keep every image of those digits in their share."""
    from myproject.data.digit_classes import DigitClassesDataModule

    data = DigitClassesDataModule(classes=[6, 7, 8, 9], train_per_class=5, val_size=0.25, test_size=0.25)
    assert data.num_classes == 4 and data.split_sizes() == {"train": 20, "val": 178, "test": 178}
    assert torch.bincount(data.splits["train"].tensors[1]).tolist() == [5, 5, 5, 5]
    everything = DigitsDataModule()
    everything.setup()
    images = torch.cat([everything.splits[split].tensors[0] for split in ("train", "val", "test")])
    labels = torch.cat([everything.splits[split].tensors[1] for split in ("train", "val", "test")])
    x, y = data.splits["val"][0]  # an image of digit y + 6, exactly as the whole data set holds it
    assert any(torch.equal(x, image) for image in images[labels == int(y) + 6])


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


def test_negative_split_sizes_are_refused():
    with pytest.raises(UserError) as refused:
        DigitsDataModule(global_batch_size=8, val_size=-1).split_sizes()
    assert str(refused.value) == "val_size=-1 must be >= 0: a count (>= 1), or a fraction (< 1) of 1797"
    with pytest.raises(ValueError, match=r"^split sizes must be >= 0, got \{'train': 4096, 'val': 512, 'test': -1\}$"):
        SyntheticDataModule(global_batch_size=8, test_size=-1)


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


def test_an_unreachable_archive_is_one_clear_message(tmp_path):
    dm = ImageFolderDataModule(root=str(tmp_path / "imgs"), url="http://127.0.0.1:9/imgs.tgz", global_batch_size=4)
    with pytest.raises(UserError, match=r"^could not download data.url=http://127.0.0.1:9/imgs.tgz"):
        dm.prepare_data()


def test_cifar10_offline_download_gives_one_clear_message(tmp_path, monkeypatch):
    # Point the download at a closed local port: the same failure as a machine with no network, but instant.
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    dm = CIFAR10DataModule(root=str(tmp_path), download=True, global_batch_size=8)
    with pytest.raises(UserError, match=r"could not download CIFAR-10 .* seems offline"):
        dm.prepare_data()


def test_imagefolder_with_only_a_test_split_evaluates_but_does_not_train(image_tree, tmp_path):
    """eval.py +data.root=DIR needs only the test split; training with it is refused in one message."""
    shutil.rmtree(image_tree / "train")
    dm = ImageFolderDataModule(root=str(image_tree), image_size=32, global_batch_size=4, num_workers=0)
    dm.setup()
    assert {split: len(ds) for split, ds in dm.splits.items()} == {"val": 6, "test": 6}
    with pytest.raises(UserError, match=r"ImageFolderDataModule has no train split \(only val, test\)"):
        run_job("train", ["data=imagefolder", f"data.root={image_tree}", f"hydra.run.dir={tmp_path}"], PROJECT)


def test_cifar10_batches_are_uint8_and_normalise_to_what_they_were():
    """CIFAR-10's evaluation splits before: ToTensor + Normalize on the PIL image of each row of the array."""
    array = np.random.default_rng(0).integers(0, 256, (6, 32, 32, 3), dtype=np.uint8)
    images = UInt8Images(array, [0, 1, 2, 3, 4, 5])
    batch = torch.stack([images[i][0] for i in range(6)])
    assert batch.dtype == torch.uint8 and batch.shape == (6, 3, 32, 32)
    before = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
    expected = torch.stack([before(Image.fromarray(row)) for row in array])
    dm = CIFAR10DataModule(root="unused", global_batch_size=6)  # normalised after the copy to the device
    assert torch.equal(dm.on_after_batch_transfer((batch, torch.arange(6)), 0)[0], expected)


def test_gpu_decoding_is_refused_without_a_gpu(image_tree):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: decode_device=cuda is allowed")
    with pytest.raises(UserError, match=r"^data.decode_device=cuda decodes JPEGs on a CUDA GPU, and none is visible"):
        ImageFolderDataModule(root=str(image_tree), global_batch_size=4, decode_device="cuda")


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(folder, base URL): files put in the folder are downloadable from the URL."""
    folder = tmp_path_factory.mktemp("served")
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=folder))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield folder, f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()


@pytest.fixture(autouse=True)
def no_proxy_for_localhost(monkeypatch):
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


def fake_cifar10(folder: Path, per_batch: int, test: int) -> dict:
    """cifar-10-python.tar.gz in torchvision's layout, with random images; returns the checksums to patch in."""
    rng = np.random.default_rng(0)
    inner = folder / "cifar-10-batches-py"
    inner.mkdir()
    names = [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]
    for name in names:
        count = test if name == "test_batch" else per_batch
        entry = {"data": rng.integers(0, 256, (count, 3072), dtype=np.uint8), "labels": [i % 10 for i in range(count)]}
        (inner / name).write_bytes(pickle.dumps(entry))
    (inner / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"class{i}" for i in range(10)]}))
    archive = folder / CIFAR10.filename
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(inner, arcname=inner.name)
    md5 = {name: calculate_md5(inner / name) for name in [*names, "batches.meta"]}
    return {
        "tgz_md5": calculate_md5(archive),
        "train_list": [[name, md5[name]] for name in names[:5]],
        "test_list": [["test_batch", md5["test_batch"]]],
        "meta": {**CIFAR10.meta, "md5": md5["batches.meta"]},
    }


@pytest.mark.slow  # an end-to-end run
def test_first_cifar10_run_downloads_then_plans(server, tmp_path, monkeypatch):
    folder, url = server
    for name, value in fake_cifar10(folder, per_batch=8, test=10).items():
        monkeypatch.setattr(CIFAR10, name, value)
    monkeypatch.setattr(CIFAR10, "url", f"{url}/{CIFAR10.filename}")
    monkeypatch.setattr(CIFAR10DataModule, "TRAIN_SIZE", 40)  # the fake's sizes, stated as the real ones are
    monkeypatch.setattr(CIFAR10DataModule, "TEST_SIZE", 10)
    root = tmp_path / "data" / "cifar10"  # does not exist yet: the first run of a new machine
    overrides = ["data=cifar10", f"data.root={root}", "data.val_size=8", "data.global_batch_size=8"]
    overrides += ["data.num_workers=0", "model.net.in_channels=3", *QUICK, f"hydra.run.dir={tmp_path / 'run'}"]
    metrics = run_job("train", overrides, PROJECT)
    assert (root / "cifar-10-batches-py" / "data_batch_5").is_file()
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["dataset_sizes"] == {"train": 32, "val": 8, "test": 10}
    assert plan["steps_per_epoch"] == 4 and metrics["test/samples"] == 10


def test_dry_run_plans_a_cluster_job_without_the_data(tmp_path):
    root, run_dir = tmp_path / "no-cifar-here", tmp_path / "run"
    plan = run_job(
        "train",
        [
            "experiment=cifar10_resnet18",
            "dry_run=true",
            "trainer.devices=4",
            f"data.root={root}",
            f"hydra.run.dir={run_dir}",
        ],
        PROJECT,
    )
    assert plan["dataset_sizes"] == {"train": 45000, "val": 5000, "test": 10000}
    assert (plan["world_size"], plan["global_batch_size"], plan["steps_per_epoch"]) == (4, 512, 87)
    assert (plan["warmup_steps"], plan["total_steps"]) == (2 * 87, 30 * 87)
    assert not root.exists()  # nothing fetched


def test_first_imagefolder_run_fetches_its_archive(server, image_tree, tmp_path):
    folder, url = server
    with tarfile.open(folder / "pets.tar.gz", "w:gz") as tar:
        tar.add(image_tree, arcname="pets")
    root = tmp_path / "data" / "pets"
    overrides = ["data=imagefolder", f"data.root={root}", f"data.url={url}/pets.tar.gz", "data.image_size=8"]
    overrides += ["data.global_batch_size=4", "data.num_workers=0", "model.net.in_channels=3", *QUICK]
    metrics = run_job("train", [*overrides, f"hydra.run.dir={tmp_path / 'run'}"], PROJECT)
    assert (root / "train" / "dog" / "5.png").is_file()
    assert not (root.parent / "pets.tar.gz").exists()  # unpacked, then removed
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["dataset_sizes"] == {"train": 12, "val": 6, "test": 6} and metrics["test/samples"] == 6
    assert OmegaConf.load(tmp_path / "run" / "config.yaml").model.net.num_classes == 2
