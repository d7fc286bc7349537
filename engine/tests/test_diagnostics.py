"""The diagnostics on a real (tiny) fit: a slow loader shows up as data wait, the step count as throughput."""

import logging
import math
import time

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, Dataset, TensorDataset

from scaleup.callbacks.diagnostics import TrainingDiagnostics, compute_dtype, loader_workers_needed
from scaleup.observability import figures
from scaleup.observability.figures import ClassificationFigures


class SlowData(Dataset):
    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay)
        return torch.randn(8), torch.tensor(i % 2)


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class DictData(SlowData):
    """Samples as dicts, as docs/contract.md allows: batches are dicts of tensors."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = super().__getitem__(i)
        return {"x": x, "y": y}


class TinyOnDicts(Tiny):
    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self(batch["x"]), batch["y"])


class InMemory(L.LightningDataModule):
    """A data module that says it holds its data in memory, as the template's digits does: loader workers would only
    add start-up time."""

    in_memory = True

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def train_dataloader(self) -> DataLoader:
        return DataLoader(SlowData(self.delay), batch_size=4)


def fit(
    delay: float,
    tmp_path,
    module: L.LightningModule | None = None,
    data: type = SlowData,
    flops: bool = True,
    in_memory: bool = False,
):
    """One epoch of `module` (a Tiny) with the diagnostics, on `data` or an InMemory data module: the logged
    metrics."""
    trainer = L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        callbacks=[TrainingDiagnostics(flops=flops)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module or Tiny(), InMemory(delay) if in_memory else DataLoader(data(delay), batch_size=4))
    return {name: float(value) for name, value in trainer.callback_metrics.items()}


@pytest.mark.slow  # an end-to-end run
def test_a_slow_loader_is_data_wait_and_flops_are_counted(tmp_path, caplog):
    # 400 ms of loading per batch against a step of a few ms (a Linear layer plus Lightning's own work per step,
    # which grows on a loaded machine: 45 ms with 3 busy processes on 2 cores, where 100 ms of loading gave a wait
    # share of 0.69, and 200 ms once 0.78)
    slow = fit(0.1, tmp_path)
    assert slow["perf/data_wait"] > 0.8
    # 8 steps of 4 samples with at least 400 ms of loading before each: the first is not timed (its forward's FLOPs
    # are counted, which slows it down; the first use of torch's FlopCounterMode takes seconds), and the wait before
    # the second is not counted (nothing before it was timed): at most 28 samples in 6 x 400 ms.
    assert 0 < slow["perf/samples_per_s"] < 28 / (6 * 0.4)
    assert slow["perf/peak_mem_gb"] > 0
    # Linear(8, 2): 2 * 8 * 2 FLOPs forward per sample, 3x that with the backward pass.
    assert slow["perf/tflops_per_s"] == pytest.approx(96 * slow["perf/samples_per_s"] / 1e12)
    assert "perf/mfu" not in slow  # no peak FLOPs known for a CPU
    # The main process loads (num_workers=0): at most 1 / 100 ms = 10 samples/s, against a step of a few ms for 4
    # samples, so feeding it takes many workers; the line says how many, as a warning (the loader holds it back).
    per_worker, needed = slow["perf/loader_samples_per_s_per_worker"], slow["perf/loader_workers_needed"]
    assert 0 < per_worker <= 10 and needed > 4
    [line] = [r for r in caplog.records if r.getMessage().startswith("loaders:")]
    assert line.levelname == "WARNING" and f"delivers {per_worker:.0f} samples/s (data.num_workers=0" in line.message
    assert f"keeping up needs about {math.ceil(needed)} workers per device" in line.message


@pytest.mark.slow  # an end-to-end run
def test_data_held_in_memory_gets_the_loader_line_but_no_warning(tmp_path, caplog):
    """The same slow loader from a data module that says its data is in memory: the line says the same, as
    information. A default run on digits (in memory, 120,000 samples/s from the main process) warned "data wait 30%:
    keeping up needs about 1 worker per device", where much of that wait is the loop's own work between batches."""
    with caplog.at_level(logging.INFO, logger="scaleup"):
        slow = fit(0.02, tmp_path, flops=False, in_memory=True)
    [line] = [r for r in caplog.records if r.getMessage().startswith("loaders:")]
    assert slow["perf/data_wait"] > 0.5 and line.levelname == "INFO"
    assert "(data.num_workers=0, data wait" in line.message and "keeping up needs about" in line.message


@pytest.mark.parametrize(("module", "data"), [(Tiny, SlowData), (TinyOnDicts, DictData)], ids=["tuples", "dicts"])
def test_flops_are_counted_as_the_module_consumes_its_batches_and_change_nothing(module, data, tmp_path):
    """The forward of the first training step, counted in the step itself: 96 FLOPs per sample for Linear(8, 2)
    whatever the batch's structure (with dict batches it called the module on the dict: a TypeError inside
    torch's Linear), and the weights trained equal those of a run that counts nothing."""
    weights = []
    for flops in (True, False):
        torch.manual_seed(0)
        net = module()
        metrics = fit(0.0, tmp_path, net, data, flops=flops)
        weights.append(net.net.weight.detach().clone())
        if flops:
            assert metrics["perf/tflops_per_s"] == pytest.approx(96 * metrics["perf/samples_per_s"] / 1e12)
        else:
            assert "perf/tflops_per_s" not in metrics
    assert torch.equal(*weights)


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [
        ("bf16-mixed", torch.bfloat16),
        ("16-mixed", torch.float16),
        ("32-true", torch.float32),
        ("64-true", torch.float64),
    ],
)
def test_compute_dtype_of_each_precision(precision, dtype):
    assert compute_dtype(precision) is dtype


def test_the_workers_needed_follow_from_the_data_wait():
    # No workers: the main process loaded 9 of 10 batches (288 of 320 samples) in the 2 s of wait, 144 samples/s,
    # against 320 computed in 1 s: 2.2 workers.
    assert loader_workers_needed(2.0, 1.0, 320, 10, 0) == pytest.approx((144, 320 / 144, True))
    # 4 workers kept the device waiting 5 s of 6: each delivered 320 / 6 / 4 samples/s, and 320/s takes 24 of them.
    assert loader_workers_needed(5.0, 1.0, 320, 10, 4) == pytest.approx((320 / 24, 24, True))
    # 1 worker that keeps up (0.1% wait): it delivers at least the throughput, and it suffices.
    assert loader_workers_needed(0.01, 10.0, 320, 10, 1) == pytest.approx((320 / 10.01, 1, False))
    assert loader_workers_needed(1.0, 1.0, 32, 1, 0) == (0, 0, False)  # one step: no wait measured


def test_figures_of_a_test_on_dict_batches_are_skipped_not_a_crash(tmp_path):
    """ClassificationFigures draws (images, labels) batches; a module whose batches are dicts tests all the same."""

    class TestedOnDicts(TinyOnDicts):
        def test_step(self, batch, batch_idx):
            self.log("test/loss", torch.nn.functional.cross_entropy(self(batch["x"]), batch["y"]))

    figures = ClassificationFigures()
    trainer = L.Trainer(
        callbacks=[figures], logger=TensorBoardLogger(tmp_path), enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip  # a logger that takes images: without one the figures are not even looked at
    trainer.test(TestedOnDicts(), DataLoader(DictData(0.0), batch_size=4), verbose=False)
    assert "test/loss" in trainer.callback_metrics


class TestedOnPairs(Tiny):
    """Tiny on one-channel 2 x 4 images: a classifier's (images, labels) batches."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))

    def test_step(self, batch, batch_idx):
        self.log("test/loss", torch.nn.functional.cross_entropy(self(batch[0]), batch[1]))


@pytest.mark.parametrize(("logger", "drawn"), [(False, []), (None, ["confusion matrix", "misclassified"])])
def test_figures_are_drawn_only_for_a_logger_that_takes_images(logger, drawn, tmp_path, monkeypatch):
    """Without a logger that takes images (logger=none, CSV) a test draws nothing: matplotlib's drawing would take a
    second and show nowhere. With TensorBoard (None: a TensorBoardLogger in tmp_path) it draws both figures."""
    figures_drawn = []

    def drawing(figure):
        figures_drawn.append("confusion matrix" if "confusion" in figure.axes[0].get_title() else "misclassified")
        return np.zeros((1, 1, 3), dtype=np.uint8)

    monkeypatch.setattr(figures, "render", drawing)
    trainer = L.Trainer(
        callbacks=[ClassificationFigures()], logger=TensorBoardLogger(tmp_path) if logger is None else logger,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    torch.manual_seed(0)  # an untrained model on random labels: some of the 32 samples are misclassified
    images = TensorDataset(torch.randn(32, 1, 2, 4), torch.arange(32) % 2)
    trainer.test(TestedOnPairs(), DataLoader(images, batch_size=8), verbose=False)
    assert figures_drawn == drawn
