"""Checkpoint URLs (s3://, gs://, ...) go through fsspec, shown on fsspec's in-memory filesystem."""

import pathlib
import uuid

import fsspec
import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from scaleup.build import build_model
from scaleup.checkpoints.io import AtomicCheckpointIO, load_checkpoint
from scaleup.errors import UserError
from testbed.data import DigitsDataModule


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    """A fresh memory:// location; the test runs in an empty directory, to see that nothing lands on disk."""
    monkeypatch.chdir(tmp_path)
    root = f"memory://bucket-{uuid.uuid4().hex[:8]}"
    yield root
    fs = fsspec.filesystem("memory")
    fs.rm(root, recursive=True)
    assert list(tmp_path.iterdir()) == []


def test_save_load_remove_through_fsspec(bucket):
    io = AtomicCheckpointIO()
    path = f"{bucket}/run/checkpoints/last.ckpt"
    io.save_checkpoint({"global_step": 7, "w": torch.arange(3.0)}, path)
    assert fsspec.filesystem("memory").isfile(path)
    loaded = io.load_checkpoint(path)
    assert loaded["global_step"] == 7 and torch.equal(loaded["w"], torch.arange(3.0))
    io.remove_checkpoint(path)
    with pytest.raises(UserError, match=f"checkpoint {path} does not exist"):
        load_checkpoint(path)


class Payload:
    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path("payload-ran"),))


def test_remote_reads_refuse_pickled_code(bucket):
    path = f"{bucket}/evil.ckpt"
    with fsspec.open(path, "wb") as f:
        torch.save({"state_dict": {}, "extra": Payload()}, f)
    with pytest.raises(UserError, match=r"refused to load .* could run arbitrary code"):
        AtomicCheckpointIO().load_checkpoint(path)


def fit(max_epochs: int, dirpath: str, ckpt_path: str | None = None) -> L.Trainer:
    model = build_model(
        {
            "_target_": "testbed.models.ImageClassifier",
            "net": {"_target_": "testbed.models.DigitsCNN", "num_classes": 10, "width": 4},
            "optimizer": {"_target_": "torch.optim.SGD", "lr": 0.1},
        }
    )
    trainer = L.Trainer(
        max_epochs=max_epochs,
        limit_train_batches=2,
        limit_val_batches=1,
        callbacks=[ModelCheckpoint(dirpath=dirpath, filename="last")],
        plugins=[AtomicCheckpointIO()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=".",
    )
    datamodule = DigitsDataModule(global_batch_size=64, num_workers=0)
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.slow  # an end-to-end run
def test_trainer_writes_and_resumes_from_a_url(bucket):
    dirpath = f"{bucket}/run/checkpoints"
    fit(1, dirpath)
    assert load_checkpoint(f"{dirpath}/last.ckpt")["global_step"] == 2
    resumed = fit(2, dirpath, ckpt_path=f"{dirpath}/last.ckpt")
    assert resumed.global_step == 4
    assert load_checkpoint(f"{dirpath}/last.ckpt")["global_step"] == 4
