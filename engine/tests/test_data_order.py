"""A first run fetches its data: prepare_data (download), then setup, then the plan; a dry run needs no data.

The example project's tests download CIFAR-10 and an image archive from a local server through torchvision's own
code; here, a user's data module whose prepare_data writes the files its setup reads, and processes that start
together.
"""

import json
import multiprocessing
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import TensorDataset

from conftest import in_process
from scaleup.data.datamodule import GlobalBatchDataModule, sizes_for_plan
from testbed.data import DigitsDataModule

QUICK = [
    "trainer.max_epochs=1",
    "logger=none",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "trainer.num_sanity_val_steps=0",
    "model.net.width=4",
]


def test_dry_run_without_an_image_tree_marks_the_steps_unknown(tmp_path):
    root, run_dir = tmp_path / "none", tmp_path / "run"
    plan = in_process(
        ["data=image_tree", f"data.root={root}", "dry_run=true", "trainer.devices=8", f"hydra.run.dir={run_dir}"]
    )
    assert plan["dataset_sizes"] == {} and plan["steps_per_epoch"] is None and plan["total_steps"] is None
    assert (plan["world_size"], plan["per_device_batch_size"]) == (8, 8)  # the batch plan needs no data
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
