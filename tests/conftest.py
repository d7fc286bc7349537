"""Shared helpers: run the real entry points as subprocesses, read what a run leaves on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

# A short run: 2 epochs of digits, no progress bar, no model summary.
QUICK = [
    "trainer.max_epochs=2",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "trainer.num_sanity_val_steps=0",
]

# Variables a parent launcher may have left behind; a stray LOCAL_RANK makes Lightning wait for ranks that never come.
LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])  # for tests/probes.py
    env["OMP_NUM_THREADS"] = "1"  # keep 2-process runs from fighting over the 2 cores
    env.update(extra)
    return env


def merged(args: list[str]) -> list[str]:
    """Overrides with repeated keys collapsed, the last one winning (Hydra itself would not say which wins)."""
    by_key = {arg.split("=", 1)[0]: arg for arg in args}
    return list(by_key.values())


def run(
    args: list[str], *, script: str = "train.py", timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run an entry point from the repo root, the way a user would."""
    return subprocess.run(
        [sys.executable, script, *merged(args)],
        cwd=ROOT,
        env=env or clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start(command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a command from the repo root in the background, stdout and stderr merged."""
    return subprocess.Popen(
        command, cwd=ROOT, env=env or clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]


def assert_same_weights(a: dict, b: dict, rtol: float, atol: float) -> float:
    """Assert two state_dicts match; return the largest absolute difference."""
    assert a.keys() == b.keys()
    worst = 0.0
    for key in a:
        if a[key].is_floating_point():
            torch.testing.assert_close(a[key], b[key], rtol=rtol, atol=atol, msg=key)
            worst = max(worst, (a[key] - b[key]).abs().max().item())
        else:
            assert torch.equal(a[key], b[key]), key
    return worst


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """One default-config training run (12 epochs of digits, ~10 s), shared by the end-to-end tests."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    check(run(["trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}"]))
    return run_dir
