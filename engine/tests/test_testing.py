"""scaleup.testing, the checks a project's own tests call: they pass on the example project (tests/test_project.py
runs them all) and fail on code outside the contract, naming what is wrong."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from test_contract import ENCODER
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from conftest import PROJECT, ROOT
from scaleup.api import GlobalBatchDataModule, UserError
from scaleup.testing import check_contract

LOADER_SETTINGS = inspect.signature(GlobalBatchDataModule.__init__).parameters


class Stream(IterableDataset):
    """A data set that can only be iterated: no sampler can order or shard it."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self):
        return iter(self.data)


class StreamedTraining(GlobalBatchDataModule):
    """Digit-shaped random data whose training split streams: outside the contract (map-style splits)."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(**{key: value for key, value in settings.items() if key in LOADER_SETTINGS})

    def model_settings(self) -> dict[str, Any]:
        return {"net.num_classes": 10, "net.in_channels": 1}

    def build_splits(self) -> dict[str, Dataset]:
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(128, 1, 8, 8, generator=generator), torch.arange(128) % 10)
        return {"train": Stream(data), "val": data, "test": data}


def test_the_contract_check_refuses_what_train_py_refuses():
    with pytest.raises(UserError, match=r"SchedulerClassifier\.configure_optimizers returns a learning-rate scheduler"):
        check_contract(["model._target_=user_modules.SchedulerClassifier"], project=ROOT)


def test_the_contract_check_refuses_a_streamed_split_and_names_a_network_export_cannot_find():
    encoder = [arg for arg in ENCODER if arg.startswith(("model.", "~model.", "+model."))]
    with pytest.raises(UserError, match=r"the train split of StreamedTraining is an IterableDataset \(Stream\)"):
        check_contract(["data._target_=test_testing.StreamedTraining", *encoder], project=PROJECT)
    with pytest.raises(AssertionError) as error:
        check_contract(encoder, project=PROJECT)
    assert str(error.value).splitlines() == [
        "DigitsDataModule / EncoderModule:",
        "  export.py's module=net: EncoderModule has no submodule 'net'; its children are encoder, metrics: pass "
        "module=<one of them>",
    ]


def test_a_job_run_in_this_process_and_refused_leaves_no_run_directory(tmp_path):
    """run_job as the entry point: a refused run removes the run directory it made, and the parents it made; a
    directory that was there before stays, with what it held (test_errors' entry-point cases show the same of
    `python train.py`)."""
    from scaleup.testing import run_job

    new = tmp_path / "new" / "run"
    with pytest.raises(UserError, match=r"trainer\.max_epochs=abc must be an integer"):
        run_job("train", ["trainer.max_epochs=abc", f"hydra.run.dir={new}"], project=PROJECT)
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    with pytest.raises(UserError):
        run_job("train", ["trainer.max_epochs=abc", f"hydra.run.dir={tmp_path / 'kept'}"], project=PROJECT)
    assert (tmp_path / "kept" / "notes.txt").read_text() == "mine"
