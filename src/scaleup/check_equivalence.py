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

import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from scaleup.engine.config import flatten

STEPS = 8
CHECK = [
    "trainer.accelerator=cpu",
    f"trainer.max_steps={STEPS}",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "logger=none",
    "lr_schedule.warmup_epochs=0",
]
# Largest relative weight difference that still counts as the same result.
TOLERANCE = {"64-true": 1e-10, "32-true": 1e-4}
NAMES = {"64-true": "float64", "32-true": "float32"}


def relative_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    return {
        key: ((a[key] - b[key]).abs().max() / a[key].abs().max().clamp_min(1e-12)).item()
        for key in a
        if a[key].is_floating_point()
    }


def start_run(devices: int, overrides: list[str], run_dir: Path) -> subprocess.Popen:
    """`train.py` on `devices` CPU processes, in the background, its output in <run_dir>.out."""
    run_dir.mkdir(parents=True)
    command = [sys.executable, "train.py", *CHECK, *overrides, f"trainer.devices={devices}", f"hydra.run.dir={run_dir}"]
    with open(run_dir.with_suffix(".out"), "w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)


def finished_weights(proc: subprocess.Popen, devices: int, run_dir: Path) -> dict[str, torch.Tensor] | None:
    """The run's final weights, or None (with the end of its output shown) if it failed."""
    if proc.wait() != 0:
        print(run_dir.with_suffix(".out").read_text()[-5000:], file=sys.stderr)
        print(f"error: the {devices}-process run failed (above)", file=sys.stderr)
        return None
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


def explanations(plans: dict[int, dict[str, Any]], model_cfg: dict[str, Any]) -> list[str]:
    """What the runs' plans and config say makes 1 and 2 processes differ by design, before any bug of yours."""
    reasons = []
    one, two = plans[1], plans[2]
    if one.get("has_batchnorm") and one.get("bn_batch_size") != two.get("bn_batch_size"):
        reasons.append(
            f"BatchNorm: its statistics come from {one['bn_batch_size']} samples on 1 process and "
            f"{two['bn_batch_size']} per device on 2 ({two['sync_batchnorm_reason']}), so the runs normalise "
            "differently by design; check your code with model.net.norm=group"
        )
    dropouts = {key: value for key, value in flatten(model_cfg).items() if "dropout" in key and value}
    if dropouts:
        settings = ", ".join(f"model.{key}={value}" for key, value in dropouts.items())
        reasons.append(f"dropout ({settings}): each process draws its own masks; check with them at 0")
    return reasons


def verdict(
    one: dict[str, torch.Tensor],
    two: dict[str, torch.Tensor],
    precision: str,
    reasons: Sequence[str] = (),
) -> tuple[int, list[str]]:
    """(0 equivalent or 1 not, the lines to print) for the final weights of the 1- and 2-process runs, and what
    the plans say makes them differ (`explanations`)."""
    tolerance = TOLERANCE.get(precision, TOLERANCE["32-true"])
    name = NAMES.get(precision, precision)
    differences = relative_differences(one, two)
    worst = max(differences, key=differences.get)
    lines = [f"largest relative weight difference: {differences[worst]:.2e} ({worst}), tolerance {tolerance:g}"]
    if differences[worst] <= tolerance:
        return 0, [*lines, f"EQUIVALENT in {name}: moving to more devices changes the speed, not the result"]
    if reasons:
        because = "; ".join(reasons)
        return 1, [*lines, f"NOT EQUIVALENT in {name}, as expected from the configuration: {because}"]
    advice = (
        f"NOT EQUIVALENT in {name}: the 2-process run optimises something else. Check the loss is a mean over the "
        "device's batch, and that nothing divides by a global count or all_reduces by hand."
    )
    if precision != "64-true":
        advice += " float32 rounding differs between CPUs: confirm in float64 (without --float32) first."
    return 1, [*lines, advice]


def main(argv: list[str]) -> int:
    """0: equivalent, 1: not equivalent, 2: a run failed."""
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    if not Path("train.py").is_file():
        print("error: run this from the project root, where train.py is", file=sys.stderr)
        return 2
    overrides = [arg for arg in argv if arg != "--float32"]
    precision = "32-true" if "--float32" in argv else "64-true"
    given = [arg for arg in overrides if arg.startswith("trainer.precision=")]
    if given:  # the user's own precision wins; judged with the float32 tolerance unless it is float64
        precision = given[-1].split("=", 1)[1]
    else:
        overrides = [f"trainer.precision={precision}", *overrides]
    print(f"comparing 1 vs 2 CPU processes after {STEPS} steps in {NAMES.get(precision, precision)}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        run_dirs = {devices: Path(tmp) / str(devices) for devices in (1, 2)}
        procs = {devices: start_run(devices, overrides, run_dirs[devices]) for devices in (1, 2)}  # side by side
        weights = {devices: finished_weights(procs[devices], devices, run_dirs[devices]) for devices in (1, 2)}
        if weights[1] is None or weights[2] is None:
            return 2
        plans = {devices: json.loads((run_dirs[devices] / "plan.json").read_text()) for devices in (1, 2)}
        model_cfg = OmegaConf.to_container(OmegaConf.load(run_dirs[1] / "config.yaml"))["model"]
    code, lines = verdict(weights[1], weights[2], precision, explanations(plans, model_cfg))
    print("\n".join(lines))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
