"""Does your module train the same on 1 and on 2 devices? `python -m scaleup.check_equivalence [--float32] [overrides]`.

Runs `train.py` twice on CPU, on 1 process and on 2 (gloo), with the same seed and global batch for a few
steps, and compares the final weights. Differences beyond rounding mean the 2-process run optimises something
else: a loss normalised by a global count, a manual all_reduce without dividing by the world size, per-rank
randomness in the model, or batch statistics (BatchNorm). Run it with `model.net.norm=group` and no dropout so
that only your code can differ.

It compares in float64 (`trainer.precision=64-true`) by default: there, a correct module agrees to ~1e-15. In
float32 the two runs agree only to rounding, which depends on the CPU's kernels and grows with training, so a
float32 comparison (`--float32`) needs a loose tolerance and can pass on one machine and fail on another.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch

STEPS = 8
CHECK = [
    "trainer.accelerator=cpu",
    f"trainer.max_steps={STEPS}",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "logger=none",
    "callbacks.lr_scaling.warmup_epochs=0",
]
# Largest relative weight difference that still counts as the same result.
TOLERANCE = {"64-true": 1e-10, "32-true": 1e-4}


def relative_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    return {
        key: ((a[key] - b[key]).abs().max() / a[key].abs().max().clamp_min(1e-12)).item()
        for key in a
        if a[key].is_floating_point()
    }


def trained_weights(devices: int, overrides: list[str], run_dir: Path) -> dict[str, torch.Tensor] | None:
    """The final weights of `train.py` on `devices` CPU processes, or None (with its output shown) if it failed."""
    command = [sys.executable, "train.py", *CHECK, *overrides, f"trainer.devices={devices}", f"hydra.run.dir={run_dir}"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        print(result.stdout[-2000:], result.stderr[-4000:], sep="\n", file=sys.stderr)
        print(f"error: the {devices}-process run failed (above)", file=sys.stderr)
        return None
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


def main(argv: list[str]) -> int:
    """0: equivalent, 1: not equivalent, 2: a run failed."""
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    if not Path("train.py").is_file():
        print("error: run this from the project root, where train.py is", file=sys.stderr)
        return 2
    float32 = "--float32" in argv
    overrides = [arg for arg in argv if arg != "--float32"]
    precision = "32-true" if float32 else "64-true"
    given = [arg for arg in overrides if arg.startswith("trainer.precision=")]
    if given:  # the user's own precision wins; judged with the float32 tolerance unless it is float64
        precision = given[-1].split("=", 1)[1]
    else:
        overrides = [f"trainer.precision={precision}", *overrides]
    tolerance = TOLERANCE.get(precision, TOLERANCE["32-true"])
    name = {"64-true": "float64", "32-true": "float32"}.get(precision, precision)
    print(f"comparing 1 vs 2 CPU processes after {STEPS} steps in {name} (relative tolerance {tolerance:g})")

    weights = {}
    with tempfile.TemporaryDirectory() as tmp:
        for devices in (1, 2):
            weights[devices] = trained_weights(devices, overrides, Path(tmp) / str(devices))
            if weights[devices] is None:
                return 2
    differences = relative_differences(weights[1], weights[2])
    worst = max(differences, key=differences.get)
    print(f"largest relative weight difference: {differences[worst]:.2e} ({worst})")
    if differences[worst] > tolerance:
        print(
            f"NOT EQUIVALENT in {name}: the 2-process run optimises something else. Check the loss is a mean over "
            "the device's batch, that nothing divides by a global count or all_reduces by hand, and run with "
            "model.net.norm=group and no dropout."
            + ("" if precision == "64-true" else " float32 rounding differs between CPUs: confirm in float64 first.")
        )
        return 1
    print(f"EQUIVALENT in {name}: moving to more devices changes the speed, not the result")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
