"""`trainer.precision=auto`, TF32 and channels_last: what the plan picks for each machine, and what it applies."""

from types import SimpleNamespace

import lightning as L
import pytest
import torch

from conftest import in_process
from scaleup.callbacks.performance import apply_speed_settings, set_tf32
from scaleup.plan.topology import resolve_precision
from testbed.models import DigitsCNN


def fake_gpu(monkeypatch, capability_major: int) -> None:
    """What torch.cuda reports on a machine with one GPU of that compute capability (8 = Ampere)."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(major=capability_major))


@pytest.mark.parametrize(("major", "expected"), [(9, "bf16-mixed"), (8, "bf16-mixed"), (7, "16-mixed")])
def test_auto_on_a_gpu_picks_bf16_where_it_runs_natively(monkeypatch, major, expected):
    fake_gpu(monkeypatch, major)
    assert resolve_precision("auto", "gpu") == expected


def test_auto_on_cpu_is_float32_even_next_to_a_gpu(monkeypatch):
    fake_gpu(monkeypatch, 9)
    assert resolve_precision("auto", "cpu") == "32-true"


@pytest.mark.parametrize("setting", ["64-true", "32-true", "16-mixed", "bf16-mixed", "transformer-engine"])
def test_explicit_precision_passes_through(monkeypatch, setting):
    fake_gpu(monkeypatch, 9)
    assert resolve_precision(setting, "gpu") == setting


def test_the_plan_prints_and_saves_what_auto_chose(tmp_path, caplog):
    """A dry run plans for GPUs, none visible here: bf16-mixed with TF32. On CPU: 32-true, TF32 off."""
    caplog.set_level("INFO")
    gpu = in_process(["dry_run=true", "trainer.devices=8", f"hydra.run.dir={tmp_path / 'gpu'}"])
    assert (gpu["precision"], gpu["tf32"], gpu["channels_last"]) == ("bf16-mixed", True, False)
    assert "bf16-mixed / ddp" in caplog.text and "TF32 / channels_last  on / off" in caplog.text
    cpu = in_process(
        [
            "dry_run=true",
            "trainer.accelerator=cpu",
            "performance.channels_last=true",
            f"hydra.run.dir={tmp_path / 'cpu'}",
        ]
    )
    assert (cpu["precision"], cpu["tf32"], cpu["channels_last"]) == ("32-true", False, True)
    no_tf32 = in_process(["dry_run=true", "performance.tf32=false", f"hydra.run.dir={tmp_path / 'off'}"])
    assert no_tf32["tf32"] is False


@pytest.fixture
def tf32_flags():
    """Put torch's global TF32 flags back after the test."""
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(before[0])
    torch.backends.cudnn.allow_tf32 = before[1]


def test_tf32_switch_sets_matmul_and_cudnn_flags(tf32_flags):
    set_tf32(True)
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == ("high", True)
    set_tf32(False)
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == ("highest", False)


def test_channels_last_converts_conv_weights_and_keeps_the_outputs(tf32_flags):
    net = DigitsCNN().eval()
    x = torch.randn(4, 1, 8, 8)
    expected = net(x)
    apply_speed_settings(L.Trainer(accelerator="cpu", logger=False), net, tf32=False, channels_last=True)
    conv = net[3].weight  # 32 -> 64 channels (with one input channel both layouts are the same)
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    torch.testing.assert_close(net(x), expected, rtol=1e-5, atol=1e-6)
