"""A first run fetches its data: prepare_data (download), then setup, then the plan; a dry run needs no data.

Offline: the archives are made here and served from a local HTTP server, so torchvision's own download and
extraction code runs, for CIFAR-10, for an ImageFolder archive, and for a user's data module whose prepare_data
writes the files its setup reads.
"""

import functools
import json
import multiprocessing
import pickle
import tarfile
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from torch.utils.data import TensorDataset
from torchvision.datasets import CIFAR10
from torchvision.datasets.utils import calculate_md5

from conftest import in_process
from myproject.data import CIFAR10DataModule, DigitsDataModule
from scaleup.data.datamodule import GlobalBatchDataModule, sizes_for_plan

QUICK = [
    "trainer.max_epochs=1",
    "logger=none",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "trainer.num_sanity_val_steps=0",
    "model.net.width=4",
]


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
    metrics = in_process(overrides)
    assert (root / "cifar-10-batches-py" / "data_batch_5").is_file()
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["dataset_sizes"] == {"train": 32, "val": 8, "test": 10}
    assert plan["steps_per_epoch"] == 4 and metrics["test/samples"] == 10


def test_dry_run_plans_a_cluster_job_without_the_data(tmp_path):
    root, run_dir = tmp_path / "no-cifar-here", tmp_path / "run"
    plan = in_process(
        [
            "experiment=cifar10_resnet18",
            "dry_run=true",
            "trainer.devices=4",
            f"data.root={root}",
            f"hydra.run.dir={run_dir}",
        ]
    )
    assert plan["dataset_sizes"] == {"train": 45000, "val": 5000, "test": 10000}
    assert (plan["world_size"], plan["global_batch_size"], plan["steps_per_epoch"]) == (4, 512, 87)
    assert (plan["warmup_steps"], plan["total_steps"]) == (2 * 87, 30 * 87)
    assert not root.exists()  # nothing fetched


def image_tree(folder: Path) -> None:
    for split, count in (("train", 6), ("val", 3)):
        for label, color in (("cat", (200, 30, 0)), ("dog", (0, 30, 200))):
            (folder / split / label).mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (12, 10), color).save(folder / split / label / f"{i}.png")


def test_first_imagefolder_run_fetches_its_archive(server, tmp_path):
    folder, url = server
    image_tree(tmp_path / "pets")
    with tarfile.open(folder / "pets.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "pets", arcname="pets")
    root = tmp_path / "data" / "pets"
    overrides = ["data=imagefolder", f"data.root={root}", f"data.url={url}/pets.tar.gz", "data.image_size=8"]
    overrides += ["data.global_batch_size=4", "data.num_workers=0", "model.net.in_channels=3", *QUICK]
    metrics = in_process([*overrides, f"hydra.run.dir={tmp_path / 'run'}"])
    assert (root / "train" / "dog" / "5.png").is_file()
    assert not (root.parent / "pets.tar.gz").exists()  # unpacked, then removed
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["dataset_sizes"] == {"train": 12, "val": 6, "test": 6} and metrics["test/samples"] == 6
    assert OmegaConf.load(tmp_path / "run" / "config.yaml").model.net.num_classes == 2


def test_dry_run_without_an_image_tree_marks_the_steps_unknown(tmp_path):
    root, run_dir = tmp_path / "none", tmp_path / "run"
    plan = in_process(
        ["data=imagefolder", f"data.root={root}", "dry_run=true", "trainer.devices=8", f"hydra.run.dir={run_dir}"]
    )
    assert plan["dataset_sizes"] == {} and plan["steps_per_epoch"] is None and plan["total_steps"] is None
    assert (plan["world_size"], plan["per_device_batch_size"]) == (8, 32)  # the batch plan needs no data
    assert OmegaConf.load(run_dir / "config.yaml").model.net.num_classes is None


class DigitsOnDisk(DigitsDataModule):
    """A user's data module: prepare_data writes the file that build_splits reads."""

    def __init__(self, root: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.path = Path(root) / "digits.pt"

    def prepare_data(self) -> None:
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({name: split.tensors for name, split in super().build_splits().items()}, self.path)

    def build_splits(self) -> dict:
        stored = torch.load(self.path, weights_only=True)  # FileNotFoundError if setup ran first
        return {name: TensorDataset(*tensors) for name, tensors in stored.items()}


def test_a_users_prepare_data_runs_before_setup(tmp_path):
    root = tmp_path / "mine"
    overrides = [f"data._target_={__name__}.DigitsOnDisk", f"+data.root={root}", *QUICK]
    in_process([*overrides, f"hydra.run.dir={tmp_path / 'run'}"])
    assert (root / "digits.pt").is_file()
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["dataset_sizes"] == {"train": 1257, "val": 180, "test": 360}


class SlowDownload(GlobalBatchDataModule):
    """prepare_data takes a while and fails if another process is downloading into the same place."""

    def __init__(self, root: Path) -> None:
        super().__init__(global_batch_size=2, num_workers=0)
        self.root = root

    def prepare_data(self) -> None:
        if (self.root / "data.pt").exists():
            return
        (self.root / "downloading").touch(exist_ok=False)  # FileExistsError: two downloads at once
        time.sleep(0.5)
        torch.save(torch.arange(10.0), self.root / "data.pt")
        (self.root / "downloading").unlink()

    def build_splits(self) -> dict:
        data = TensorDataset(torch.load(self.root / "data.pt", weights_only=True))
        return {"train": data, "val": data, "test": data}


def prepare_in_a_process(root: Path, run_dir: Path, sizes: multiprocessing.Queue) -> None:
    sizes.put(sizes_for_plan(SlowDownload(root), run_dir=run_dir, dry_run=False))


@pytest.mark.slow  # an end-to-end run
def test_processes_started_together_download_once(tmp_path):
    """torchrun and srun start every process at once, before any process group exists: one downloads."""
    context = multiprocessing.get_context("fork")
    sizes = context.Queue()
    procs = [context.Process(target=prepare_in_a_process, args=(tmp_path, tmp_path / "run", sizes)) for _ in "ab"]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(30)
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert [sizes.get(timeout=1) for _ in procs] == [{"train": 10, "val": 10, "test": 10}] * 2
