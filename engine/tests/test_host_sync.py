"""No training step reads a tensor back to the host: on a GPU each such read waits for every kernel queued so far,
so the host stops running ahead and the GPU idles while the next step is prepared.

On CPU nothing waits, so the reads themselves are recorded: a TorchFunctionMode sees every Python-level `.item()`,
`float()`, `int()`, `bool()`, `.tolist()`, `.numpy()` and `.cpu()` of a tensor, the functions whose output shape
depends on the values (`bincount`, `nonzero`, `unique`, boolean-mask indexing), and host data copied onto a device
(`torch.tensor(x, device=...)`). engine/tests/test_gpu.py checks the same on a GPU with torch's sync debug mode.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, ClassVar

import lightning as L
import pytest
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from conftest import in_process
from scaleup.observability.metrics import StageMetrics

READS = {
    Tensor.item,
    Tensor.tolist,
    Tensor.numpy,
    Tensor.cpu,
    Tensor.__bool__,
    Tensor.__float__,
    Tensor.__int__,
    Tensor.__index__,
    torch.bincount,
    Tensor.bincount,
    torch.nonzero,
    Tensor.nonzero,
    torch.unique,
    Tensor.unique,
    torch.masked_select,
    Tensor.masked_select,
}
TORCH_DIR = str(Path(torch.__file__).parent) + os.sep


def caller() -> str:
    """The innermost frame outside torch: where the read was asked for."""
    frame = sys._getframe(2)
    while frame and frame.f_code.co_filename.startswith(TORCH_DIR):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}" if frame else "?"


class HostReads(TorchFunctionMode):
    """Records the calls that read tensor values on the host (or copy host data to a device) as (name, caller)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = None
        if func in READS:
            name = resolve_name(func) or str(func)
        elif func is Tensor.__getitem__ and any(
            isinstance(i, Tensor) and i.dtype == torch.bool
            for i in (args[1] if isinstance(args[1], tuple) else (args[1],))
        ):
            name = "boolean-mask indexing"
        elif func in (torch.tensor, torch.as_tensor) and "device" in kwargs and not isinstance(args[0], Tensor):
            name = f"{func.__name__}(host data, device=...)"
        if name:
            self.calls.append((name, caller()))
        return func(*args, **kwargs)


class SteadySteps(L.Callback):
    """Calls `start()` at the start of each steady-state training step and `stop()` at the next step's start, so
    the window holds the whole step: hooks, forward, backward, optimizer, Lightning's bookkeeping after the step,
    and fetching the next batch. Steady state: after the first `skip` steps, neither a logging step nor next to
    one (other callbacks' hooks at the next step's start fall in the window), not the epoch's last step."""

    def __init__(self, skip: int = 2) -> None:
        self.skip, self.steps, self._open = skip, 0, False

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int):
        self._close()
        # Lightning's logging rule: this step logs when (stepped + 1) is a multiple, the next when (stepped + 2) is.
        # It counts the optimizer steps taken, the global step here (one optimizer, no accumulation).
        stepped, every = trainer.global_step, trainer.log_every_n_steps
        near_logging = every and any((stepped + k) % every == 0 for k in (1, 2))
        if batch_idx < self.skip or trainer.is_last_batch or near_logging:
            return
        self.steps += 1
        self._open = True
        self.start(trainer, pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self._open:
            self._open = False
            self.stop()

    def start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


class HostReadProbe(SteadySteps):
    """Host reads and `LightningModule.log` calls in steady-state steps."""

    last: ClassVar[HostReadProbe | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.reads = HostReads()
        self.log_calls = 0
        HostReadProbe.last = self

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        log = pl_module.log

        def counted(*args: Any, **kwargs: Any) -> None:
            self.log_calls += self._open
            log(*args, **kwargs)

        pl_module.log = counted

    def start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.reads.__enter__()

    def stop(self) -> None:
        self.reads.__exit__(None, None, None)


@pytest.mark.slow  # an end-to-end run
def test_a_steady_state_training_step_reads_nothing_back(tmp_path):
    """train.py's defaults (progress bar, TensorBoard, diagnostics, checkpoints, LR monitor, metrics)."""
    in_process(
        [
            "data.global_batch_size=32",  # 39 steps of 1,257 digits
            "trainer.max_epochs=1",
            "trainer.num_sanity_val_steps=0",
            "model.net.width=8",
            f"+callbacks.host_reads._target_={__name__}.HostReadProbe",
            f"hydra.run.dir={tmp_path}",
        ]
    )
    probe = HostReadProbe.last
    # 39 less the first 2, the last, the 4 logging steps (every 9: log_every_n_steps=auto on 39) and the 4 before them
    assert probe.steps == 28
    assert probe.reads.calls == []
    # The step loss only: the metric objects are handed to Lightning at the epoch's first step.
    assert probe.log_calls == probe.steps


class ReadsItsLoss(L.LightningModule):
    """What the probe must catch: a `.item()` in every training step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_probe_sees_every_kind_of_host_read(tmp_path):
    data = TensorDataset(torch.randn(20, 4), torch.randint(0, 2, (20,)))
    probe = HostReadProbe()
    trainer = L.Trainer(
        max_steps=20,
        callbacks=[probe],
        log_every_n_steps=10,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(ReadsItsLoss(), DataLoader(data, batch_size=1))
    assert probe.steps == 14  # 20 less steps 1, 2, 9, 10, 19, 20
    assert [name for name, _ in probe.reads.calls] == ["torch.Tensor.item"] * 14
    assert all(f"{__file__}:" in where and where.endswith("training_step") for _, where in probe.reads.calls)

    x = torch.tensor([0.5, -1.0, 2.0])
    with HostReads() as reads:
        float(x.sum())
        x.tolist()
        bool(x.any())
        x[x > 0]
        torch.tensor([1.0], device="cpu")
        torch.as_tensor(1.0, device="cpu")
        torch.bincount(torch.tensor([1, 2]))
    assert [name for name, _ in reads.calls] == [
        "torch.Tensor.__float__",
        "torch.Tensor.tolist",
        "torch.Tensor.__bool__",
        "boolean-mask indexing",
        "tensor(host data, device=...)",
        "as_tensor(host data, device=...)",
        "torch.bincount",
    ]


def test_stage_metrics_of_the_classifier_update_without_host_reads():
    torch.manual_seed(0)
    logits, target = torch.randn(64, 10), torch.randint(0, 10, (64,))
    metrics = StageMetrics({f"acc{k}": MulticlassAccuracy(10, top_k=k, average="micro") for k in (1, 5)})
    with HostReads() as reads:
        for i in range(0, 64, 16):  # 4 batches of 16, with losses 0, 1, 2, 3
            metrics.update("train", logits[i : i + 16], target[i : i + 16], batch_size=16, loss=torch.tensor(i / 16.0))
    assert reads.calls == []
    values = {name: metric.compute() for name, metric in metrics.items("train")}
    for k in (1, 5):
        correct = (logits.topk(k).indices == target.unsqueeze(1)).any(1).float().mean()
        torch.testing.assert_close(values[f"acc{k}"], correct)
    assert (values["loss"].item(), values["samples"].item()) == (1.5, 64.0)  # (0 + 1 + 2 + 3) / 4, weighted by 16
