"""The GPU lane: what a CPU cannot show. `pytest -m gpu` runs it; without GPUs every test here is skipped (the module
still imports, so a broken import fails on any machine).

- SyncBatchNorm really syncs: 2 processes with a global batch of 64 keep the running statistics of that batch;
- `16-mixed` trains with a gradient scaler whose state is checkpointed; `bf16-mixed` computes in bfloat16;
- (FSDP on 2 GPUs, with mixed precision and CPU offload: engine/tests/test_fsdp.py);
- `callbacks=ema` keeps its average on the GPU;
- `model.compile=true` compiles on CUDA and keeps plain parameter names;
- the loaders pin host memory when the Trainer runs on a GPU;
- a steady-state training step never waits for the GPU (torch's sync debug mode raises on any host sync).
"""

import json
from typing import ClassVar

import lightning as L
import pytest
import torch
from test_host_sync import SteadySteps

from conftest import check, in_process, run, weights
from scaleup.checkpoints.io import load_checkpoint
from testbed.data import SyntheticDataModule

pytestmark = pytest.mark.gpu

QUIET = [
    "logger=none",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "trainer.num_sanity_val_steps=0",
]


def needs_gpus(count: int) -> pytest.MarkDecorator:
    visible = torch.cuda.device_count()
    return pytest.mark.skipif(visible < count, reason=f"needs {count} CUDA GPU(s), {visible} visible")


def batchnorm_statistics(ckpt) -> dict[str, torch.Tensor]:
    return {k: v for k, v in weights(ckpt).items() if k.endswith(("running_mean", "running_var"))}


@needs_gpus(2)
def test_syncbatchnorm_keeps_the_global_batch_statistics(tmp_path):
    """One optimizer step at LR 0 (weights stay as initialised, identical on every rank): the BN running statistics
    then hold only the first global batch's. One GPU sees all 64 samples; two GPUs with SyncBN must reach the same
    statistics from 32 each; without SyncBN, rank 0's statistics are those of its own 32."""
    one_step = [
        "trainer.max_steps=1",
        "model.optimizer.lr=0",
        "checkpoint.every_n_train_steps=1",
        "trainer.precision=32-true",
        "performance.tf32=false",  # full float32: TF32 convolutions would differ between batch shapes
        *QUIET,
    ]
    runs = {
        "one": ["trainer.devices=1"],
        "synced": ["trainer.devices=2", "trainer.sync_batchnorm=true"],
        "unsynced": ["trainer.devices=2", "trainer.sync_batchnorm=false"],
    }
    for name, devices in runs.items():
        check(run([*one_step, *devices, f"hydra.run.dir={tmp_path / name}"]))
    assert json.loads((tmp_path / "synced" / "plan.json").read_text())["sync_batchnorm"] is True
    one, synced, unsynced = (batchnorm_statistics(tmp_path / name / "checkpoints" / "last.ckpt") for name in runs)
    assert one.keys() == synced.keys() and len(one) == 6  # DigitsCNN: 3 BatchNorm layers
    for key in one:
        torch.testing.assert_close(synced[key], one[key], rtol=1e-4, atol=1e-5, msg=key)
    assert max((unsynced[k] - one[k]).abs().max().item() for k in one) > 1e-3  # the check can fail


class OutputDtype(L.Callback):
    """Records the dtype of the network's output during training steps (what autocast computes in)."""

    seen: ClassVar[set[torch.dtype]] = set()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.net.register_forward_hook(lambda module, args, output: OutputDtype.seen.add(output.dtype))


@needs_gpus(1)
@pytest.mark.parametrize(("precision", "dtype"), [("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)])
def test_mixed_precision_trains_in_its_dtype(precision, dtype, tmp_path):
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("this GPU has no native bfloat16")
    OutputDtype.seen.clear()
    probe = f"+callbacks.dtype_probe._target_={__name__}.OutputDtype"
    metrics = in_process(
        [f"trainer.precision={precision}", "trainer.max_epochs=3", probe, *QUIET, f"hydra.run.dir={tmp_path}"]
    )
    assert OutputDtype.seen == {dtype}
    assert metrics["test/acc"] > 0.5  # learning: chance is 0.1
    last = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert {v.dtype for v in last["state_dict"].values() if v.is_floating_point()} == {torch.float32}  # master weights
    scaler = last.get("MixedPrecision", {})  # Lightning stores the precision plugin's state under its class name
    if precision == "16-mixed":
        assert scaler["scale"] > 0 and "_growth_tracker" in scaler  # float16 gradients are scaled, and resumable
    else:
        assert not scaler  # bfloat16 has float32's range: no scaler


@needs_gpus(1)
def test_ema_averages_on_the_gpu(tmp_path):
    """callbacks=ema keeps its average on the training GPU: last.ckpt's averaged weights (`state_dict`) are CUDA
    tensors, as the training weights are; built where the model is in Lightning's setup, they would be CPU tensors
    and every step would copy all weights across."""
    in_process(["callbacks=[default,ema]", "trainer.max_epochs=1", *QUIET, f"hydra.run.dir={tmp_path}"])
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)  # each tensor where it was saved
    assert {value.device.type for value in last["state_dict"].values()} == {"cuda"}
    assert {value.device.type for value in last["current_model_state"].values()} == {"cuda"}


@needs_gpus(1)
def test_compile_on_cuda_trains_and_keeps_plain_names(tmp_path):
    from torch._dynamo.utils import counters  # dynamo's own record of the graphs it compiled

    counters.clear()
    metrics = in_process(["model.compile=true", "trainer.max_epochs=2", *QUIET, f"hydra.run.dir={tmp_path}"])
    assert counters["stats"]["unique_graphs"] >= 1
    assert metrics["test/acc"] > 0.5  # learning: chance is 0.1
    state = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")["state_dict"]
    assert not any("_orig_mod" in key for key in state)


@needs_gpus(1)
def test_loaders_pin_memory_for_a_gpu_trainer():
    datamodule = SyntheticDataModule(global_batch_size=8, train_size=64, val_size=16, test_size=16, num_workers=2)
    trainer = L.Trainer(accelerator="gpu", devices=1, logger=False, enable_progress_bar=False)
    datamodule.trainer = trainer  # what fit() does when it attaches the data module
    loader = datamodule.train_dataloader()
    images, _ = next(iter(loader))
    assert loader.pin_memory and images.is_pinned()
    assert datamodule.test_dataloader().pin_memory


class NoSyncProbe(SteadySteps):
    """Runs steady-state training steps under `torch.cuda.set_sync_debug_mode("error")`: any CUDA call that makes
    the host wait for the GPU (`.item()`, a device-to-host copy, a blocking host-to-device copy, `bincount`,
    `nonzero`, ...) raises, with the traceback of the line that asked for it."""

    last: ClassVar["NoSyncProbe | None"] = None

    def __init__(self) -> None:
        super().__init__()
        NoSyncProbe.last = self

    def start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.cuda.set_sync_debug_mode("error")

    def stop(self) -> None:
        torch.cuda.set_sync_debug_mode("default")


@needs_gpus(1)
def test_steady_state_training_steps_never_wait_for_the_gpu(tmp_path):
    """train.py's defaults (TensorBoard, diagnostics, checkpoints, LR monitor, metrics, bf16 where supported); only
    the logging steps (every 10th, when the loggers read the values) and the epoch's end may wait."""
    in_process(
        [
            "data.global_batch_size=32",  # 39 steps of 1,257 digits
            "trainer.max_epochs=1",
            f"+callbacks.no_sync._target_={__name__}.NoSyncProbe",
            f"hydra.run.dir={tmp_path}",
        ]
    )
    assert NoSyncProbe.last.steps == 30  # 39 less the first 2, the last, and steps 9, 10, 19, 20, 29, 30
