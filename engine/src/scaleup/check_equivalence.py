"""Does your module train the same on 1 and on 2 devices? `python -m scaleup.check_equivalence [--float32] [overrides]`.

Runs `train.py` three times on CPU for a few steps, with the same seed and global batch, side by side, and
compares the final weights and optimizer state:
- 2 processes (gloo) against 1 process accumulating 2 micro-batches: the same micro-batches, so the same
  dropout masks and augmentations (both drawn by position, never by rank: docs/randomness.md) and the same
  BatchNorm statistics in the forward pass. Any difference is your code's: per-rank randomness (a generator of
  your own, seeded once per process: the check names it), a manual all_reduce without dividing by the world size.
  BatchNorm's running statistics differ by design and are not compared: the 2-process checkpoint holds rank 0's,
  updated by its micro-batches only, while 1 process updates them by every micro-batch.
- 1 process with the whole batch against 1 process accumulating 2: differs by design where the model draws
  per micro-batch (dropout masks of 64 samples are not two masks of 32) or normalises over it (BatchNorm), and
  otherwise only if the loss depends on the micro-batch count: a loss normalised by a global count.

It compares in float64 (`trainer.precision=64-true`) by default: there, a correct module agrees to ~1e-15. In
float32 the runs agree only to rounding, which depends on the CPU's kernels and grows with training, so a
float32 comparison (`--float32`) needs a loose tolerance and can pass on one machine and fail on another.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from omegaconf import OmegaConf

from scaleup.config.plain import flatten
from scaleup.plan.resolve import Plan

STEPS = 8
CHECK = [
    "trainer.accelerator=cpu",
    f"trainer.max_steps={STEPS}",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "logger=none",
    "lr_schedule.warmup_epochs=0",
    "trainer.limit_test_batches=0",  # the check compares the trained state: the test would only cost time
]
# Largest relative weight difference that still counts as the same result.
TOLERANCE = {"64-true": 1e-10, "32-true": 1e-4}
NAMES = {"64-true": "float64", "32-true": "float32"}
# The three runs: name -> (processes, accumulation).
RUNS = {"1": (1, 1), "1x2": (1, 2), "2": (2, 1)}
# The module's import path for the child processes, which cannot import `__main__` (its name under `python -m`).
MODULE = "scaleup.check_equivalence"
GENERATORS = "generators.json"  # in each run directory: the generators of the user's own drawn from in training
# The buffers in which torch's norm layers (BatchNorm, InstanceNorm) keep their running statistics.
RUNNING_STATISTICS = ("running_mean", "running_var")


def relative_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    return {
        key: ((a[key] - b[key]).abs().max() / a[key].abs().max().clamp_min(1e-12)).item()
        for key in a
        if a[key].is_floating_point()
    }


def running_statistics(state_dict: dict[str, torch.Tensor]) -> list[str]:
    """The modules in `state_dict` with running statistics (BatchNorm layers)."""
    return sorted({key.rpartition(".")[0] for key in state_dict if key.rpartition(".")[2] in RUNNING_STATISTICS})


def compared_state(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """What must agree between the runs: the weights except running statistics, and the optimizer state (momentum,
    Adam's moments: a gradient scaled by a constant shows there even where Adam's update hides it)."""
    state = {
        key: value
        for key, value in checkpoint["state_dict"].items()
        if key.rpartition(".")[2] not in RUNNING_STATISTICS
    }
    for i, optimizer in enumerate(checkpoint["optimizer_states"]):
        for param, values in optimizer["state"].items():
            state.update(
                {f"optimizer_states[{i}].state[{param}].{k}": v for k, v in values.items() if torch.is_tensor(v)}
            )
    return state


def _generators(obj: Any, name: str, depth: int, seen: set[int]) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, torch.Generator | np.random.Generator | np.random.RandomState | random.Random):
        yield name, obj
        return
    if depth == 0 or id(obj) in seen or isinstance(obj, torch.Tensor | L.Trainer | str | bytes | int | float):
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        children = obj.items()
    elif isinstance(obj, list | tuple):
        children = enumerate(obj)
    elif hasattr(obj, "__dict__"):
        children = vars(obj).items()
    else:
        return
    for key, child in children:
        # nn.Module keeps its submodules in _modules: name them as a user does (model.net.noise, not _modules)
        child_name = name if key in ("_modules", "_trainer") else f"{name}.{key}"
        if key != "_trainer":
            yield from _generators(child, child_name, depth - 1, seen)


def own_generators(root: Any, name: str) -> dict[str, Any]:
    """The generators reachable from `root`'s attributes (torch.Generator, numpy's Generator and RandomState,
    random.Random): the ones a user created, which the template does not seed per step or per sample."""
    return dict(_generators(root, name, depth=8, seen=set()))


def generator_state(generator: Any) -> str:
    if isinstance(generator, torch.Generator):
        return generator.get_state().numpy().tobytes().hex()
    if isinstance(generator, np.random.Generator):
        return repr(generator.bit_generator.state)
    if isinstance(generator, np.random.RandomState):
        return repr(generator.get_state(legacy=False))
    return repr(generator.getstate())


class DrawnGenerators(L.Callback):
    """Writes `path`: the user's own generators (in the module and the data module) that training drew from.

    Added to the check's runs. Draws in loader workers change only the workers' copies of the dataset, so a
    generator drawn from there shows only with data.num_workers=0.
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.before: dict[str, str] = {}

    def _states(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, str]:
        found = {**own_generators(pl_module, "model"), **own_generators(trainer.datamodule, "data")}
        return {name: generator_state(generator) for name, generator in found.items()}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.before = self._states(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        after = self._states(trainer, pl_module)
        drawn = [name for name, state in after.items() if self.before.get(name, state) != state]
        if trainer.is_global_zero:
            self.path.write_text(json.dumps(drawn))


def start_run(devices: int, accumulation: int, overrides: list[str], run_dir: Path) -> subprocess.Popen:
    """`train.py` on `devices` CPU processes, in the background, its output in <run_dir>.out."""
    run_dir.mkdir(parents=True)
    command = [
        sys.executable,
        "train.py",
        *CHECK,
        *overrides,
        f"trainer.devices={devices}",
        *([f"trainer.accumulate_grad_batches={accumulation}"] if accumulation > 1 else []),
        f"+callbacks.drawn_generators._target_={MODULE}.{DrawnGenerators.__name__}",
        f"+callbacks.drawn_generators.path={run_dir / GENERATORS}",
        f"hydra.run.dir={run_dir}",
    ]
    with open(run_dir.with_suffix(".out"), "w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)


def finished_checkpoint(proc: subprocess.Popen, name: str, run_dir: Path) -> dict[str, Any] | None:
    """The run's last checkpoint, or None (with the end of its output shown) if it failed."""
    if proc.wait() != 0:
        print(run_dir.with_suffix(".out").read_text()[-5000:], file=sys.stderr)
        print(f"error: the {describe(name)} run failed (above)", file=sys.stderr)
        return None
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)


def describe(name: str) -> str:
    processes, accumulation = RUNS[name]
    return f"{processes}-process" + (f" accumulation-{accumulation}" if accumulation > 1 else "")


def explanations(plans: dict[str, Plan], model_cfg: dict[str, Any]) -> list[str]:
    """What the plans and config say makes the whole batch and 2 accumulated micro-batches on 1 process differ by
    design, before any bug of yours."""
    reasons = []
    whole, split = plans["1"], plans["1x2"]
    if whole.has_batchnorm and whole.bn_batch_size != split.bn_batch_size:
        reasons.append(
            f"BatchNorm: its statistics come from {whole.bn_batch_size} samples in one batch and "
            f"{split.bn_batch_size} per micro-batch, so those runs normalise differently by design"
        )
    dropouts = {key: value for key, value in flatten(model_cfg).items() if "dropout" in key and value}
    if dropouts:
        settings = ", ".join(f"model.{key}={value}" for key, value in dropouts.items())
        reasons.append(
            f"dropout ({settings}): masks are drawn per micro-batch, so a batch of {whole.per_device_batch_size} "
            f"and micro-batches of {split.per_device_batch_size} draw different ones"
        )
    return reasons


def comparison(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], precision: str, what: str) -> tuple[bool, str]:
    tolerance = TOLERANCE.get(precision, TOLERANCE["32-true"])
    differences = relative_differences(a, b)
    worst = max(differences, key=differences.get)
    line = f"{what}: largest relative difference {differences[worst]:.2e} ({worst}), tolerance {tolerance:g}"
    return differences[worst] <= tolerance, line


def verdict(
    checkpoints: dict[str, dict[str, Any]],
    precision: str,
    reasons: list[str] | tuple[str, ...] = (),
    drawn: list[str] | tuple[str, ...] = (),
) -> tuple[int, list[str]]:
    """(0 equivalent or 1 not, the lines to print) for the last checkpoints of the three RUNS, what the plans say
    makes the whole batch and its micro-batches differ (`explanations`), and the user's own generators that
    training drew from (`DrawnGenerators`)."""
    name = NAMES.get(precision, precision)
    state = {run: compared_state(checkpoint) for run, checkpoint in checkpoints.items()}
    split_same, split_line = comparison(state["1x2"], state["2"], precision, "2 processes vs 1 accumulating 2")
    batch_same, batch_line = comparison(state["1"], state["1x2"], precision, "1 process: whole batch vs 2 x half")
    lines = [split_line, batch_line]
    if modules := running_statistics(checkpoints["2"]["state_dict"]):
        named = ", ".join(modules[:4]) + (f" and {len(modules) - 4} more" if len(modules) > 4 else "")
        lines.append(
            f"not compared, different by design: the running statistics of {named} (BatchNorm): 2 "
            "processes keep rank 0's, updated by its micro-batches only, 1 process updates them by every micro-batch"
        )
    if not split_same:
        if drawn:
            culprits = ", ".join(drawn)
            because = (
                f"training drew from generators of your own ({culprits}): seeded once per process, their numbers "
                "depend on the rank, not on the samples; draw from torch's global generator instead, which the "
                "template seeds per micro-batch and per sample (docs/randomness.md)"
            )
        else:
            because = (
                "the same micro-batches give other weights or optimizer state on 2 processes: look for randomness of "
                "your own seeded per process (docs/randomness.md) and for a hand-made all_reduce that does not divide "
                "by the world size"
            )
        return 1, [*lines, f"NOT EQUIVALENT in {name}: {because}"]
    if not batch_same and not reasons:
        advice = (
            f"NOT EQUIVALENT in {name}: splitting the batch into micro-batches changes the result. Check the loss is "
            "a mean over the device's batch, and that nothing divides by a global count."
        )
        if precision != "64-true":
            advice += " float32 rounding differs between CPUs: confirm in float64 (without --float32) first."
        return 1, [*lines, advice]
    if not batch_same:
        lines.append(f"the whole batch differs from its micro-batches by design: {'; '.join(reasons)}")
    return 0, [*lines, f"EQUIVALENT in {name}: moving to more devices changes the speed, not the result"]


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
    print(
        f"comparing 2 CPU processes, 1 accumulating 2 micro-batches and 1 with the whole batch after {STEPS} steps "
        f"in {NAMES.get(precision, precision)}",
        flush=True,
    )

    with tempfile.TemporaryDirectory() as tmp:
        run_dirs = {name: Path(tmp) / name for name in RUNS}
        procs = {name: start_run(*RUNS[name], overrides, run_dirs[name]) for name in RUNS}  # side by side
        checkpoints = {name: finished_checkpoint(procs[name], name, run_dirs[name]) for name in RUNS}
        if any(checkpoint is None for checkpoint in checkpoints.values()):
            return 2
        plans = {name: Plan.from_dict(json.loads((run_dirs[name] / "plan.json").read_text())) for name in RUNS}
        ran = {name: (plans[name].world_size, plans[name].accumulate_grad_batches) for name in RUNS}
        if ran != RUNS:  # e.g. a config of the user's that sets the accumulation or the device count its own way
            print(f"error: the runs were meant as (processes, accumulation) {RUNS} but ran as {ran}", file=sys.stderr)
            return 2
        model_cfg = OmegaConf.to_container(OmegaConf.load(run_dirs["1"] / "config.yaml").model)
        drawn = json.loads((run_dirs["2"] / GENERATORS).read_text())
    code, lines = verdict(checkpoints, precision, explanations(plans, model_cfg), drawn)
    print("\n".join(lines))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
