"""Does your module train the same on 1 and on 2 devices? `python -m scaleup.check_equivalence [overrides]`.

Runs `train.py` twice on CPU, on 1 process and on 2 (gloo), with the same seed and global batch for a few
steps, and compares the final weights. Differences beyond float rounding mean the 2-process run optimises
something else: a loss normalised by a global count, a manual all_reduce without dividing by the world size,
per-rank randomness in the model, or batch statistics (BatchNorm). Run it with `model.net.norm=group` and no
dropout so that only your code can differ.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch

CHECK = [
    "trainer.accelerator=cpu",
    "trainer.max_steps=8",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "logger=none",
    "callbacks.lr_scaling.warmup_epochs=0",
]


def relative_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    return {
        key: ((a[key] - b[key]).abs().max() / a[key].abs().max().clamp_min(1e-12)).item()
        for key in a
        if a[key].is_floating_point()
    }


def main(overrides: list[str], tolerance: float = 1e-4) -> int:
    weights = {}
    with tempfile.TemporaryDirectory() as tmp:
        for devices in (1, 2):
            run_dir = Path(tmp) / str(devices)
            cmd = [
                sys.executable,
                "train.py",
                *CHECK,
                *overrides,
                f"trainer.devices={devices}",
                f"hydra.run.dir={run_dir}",
            ]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                print(result.stdout[-2000:], result.stderr[-4000:], sep="\n", file=sys.stderr)
                print(f"error: the {devices}-process run failed (above)", file=sys.stderr)
                return 2
            checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
            weights[devices] = checkpoint["state_dict"]
    differences = relative_differences(weights[1], weights[2])
    worst = max(differences, key=differences.get)
    print(f"largest relative weight difference, 1 vs 2 processes after 8 steps: {differences[worst]:.2e} ({worst})")
    if differences[worst] > tolerance:
        print(
            f"NOT EQUIVALENT (tolerance {tolerance:g}): the 2-process run optimises something else. Check the loss "
            "is a mean over the device's batch, that nothing divides by a global count or all_reduces by hand, and "
            "run with model.net.norm=group and no dropout."
        )
        return 1
    print("equivalent: moving to more devices changes the speed, not the result")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
