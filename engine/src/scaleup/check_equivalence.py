"""Does your module train the same on 1 and on 2 devices? `python -m scaleup.check_equivalence [--float32] [overrides]`.

Runs `train.py` three times on CPU for a few steps, with the same seed and global batch, side by side, and
compares the final weights and optimizer state. In all three runs the layers that compute over the micro-batch
are held: BatchNorm (any norm layer with running statistics) normalises with its running statistics, which stay
as initialised, and torch's dropout layers are off, so a whole batch and its micro-batches compute the same per
sample:
- 2 processes (gloo) against 1 process accumulating 2 micro-batches: the same micro-batches, so the same
  augmentations and in-model random numbers (both drawn by position, never by rank: docs/randomness.md). Any
  difference is your code's: per-rank randomness (a generator of your own, in an attribute or a local variable
  of a training step, seeded per process: the check names it), a manual all_reduce without dividing by the
  world size.
- 1 process with the whole batch against 1 process accumulating 2: differs if the loss depends on the
  micro-batch count (a sum, or a mean over a global count), or if a training step draws random numbers of its
  own from the global generators (a batch of 64 draws other numbers than 2 of 32: the check names them, and you
  turn them off for it).
A module with manual optimization (`automatic_optimization = False`) cannot accumulate under Lightning: its plan says
so, and the check compares 2 processes with the whole batch on 1 process only.

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
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import numpy as np
import torch
from torch import nn

from scaleup.plan.checks import BATCH_NORMS
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
# Under manual optimization (automatic_optimization=False) Lightning cannot accumulate: the runs without it.
MANUAL_RUNS = {name: RUNS[name] for name in ("1", "2")}
NO_ACCUMULATION = (
    "manual optimization (automatic_optimization=False): Lightning cannot accumulate, so no accumulation run"
)
# The module's import path for the child processes, which cannot import `__main__` (its name under `python -m`).
MODULE = "scaleup.check_equivalence"
GENERATORS = "generators.json"  # in each run directory: the generators training drew from (DrawnGenerators)
HELD = "held_layers.json"  # in each run directory: the layers HeldLayers held, by name
GENERATOR_TYPES = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)
# The layers whose training mode depends on the micro-batch: BatchNorm normalises with its statistics (and
# InstanceNorm, where it tracks running statistics, updates them once per micro-batch); dropout draws one mask per
# micro-batch tensor.
INSTANCE_NORMS = (
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LazyInstanceNorm1d, nn.LazyInstanceNorm2d,
    nn.LazyInstanceNorm3d,
)  # fmt: skip
DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
SPLIT_DEPENDENT = (*BATCH_NORMS, *INSTANCE_NORMS, *DROPOUTS)


def relative_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    return {
        key: ((a[key] - b[key]).abs().max() / a[key].abs().max().clamp_min(1e-12)).item()
        for key in a
        if a[key].is_floating_point()
    }


def compared_state(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """What must agree between the runs: the weights, and the optimizer state (momentum, Adam's moments: a gradient
    scaled by a constant shows there even where Adam's update hides it)."""
    state = dict(checkpoint["state_dict"])
    for i, optimizer in enumerate(checkpoint["optimizer_states"]):
        for param, values in optimizer["state"].items():
            state.update(
                {f"optimizer_states[{i}].state[{param}].{k}": v for k, v in values.items() if torch.is_tensor(v)}
            )
    return state


def _generators(obj: Any, name: str, depth: int, seen: set[int]) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, GENERATOR_TYPES):
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


def global_states() -> dict[str, str]:
    """The states of the global generators that StepSeed seeds before each training micro-batch."""
    return {
        "torch's": generator_state(torch.default_generator),
        "numpy's": repr(np.random.get_state(legacy=False)),
        "python's": repr(random.getstate()),
    }


class HeldLayers(L.Callback):
    """Puts the layers whose output depends on the micro-batch (SPLIT_DEPENDENT) in eval mode before every training
    micro-batch: BatchNorm normalises with its running statistics, which then stay as initialised, and dropout is
    off. A whole batch and its micro-batches then compute the same per sample, and what still tells them apart is
    the loss. Added to the check's three runs; before every micro-batch, as a hook of the user's may call train().
    Writes `path`: the held layers' names and classes."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        held = {name: type(m).__name__ for name, m in pl_module.named_modules() if isinstance(m, SPLIT_DEPENDENT)}
        if trainer.is_global_zero:
            self.path.write_text(json.dumps(held))

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        for module in pl_module.modules():
            if isinstance(module, SPLIT_DEPENDENT):
                module.eval()


class DrawnGenerators(L.Callback):
    """Writes `path`: {"own": the user's own generators that training drew from, "global": the global generators
    that training micro-batches drew from after StepSeed seeded them}.

    Own generators are those in the attributes of the module and the data module that training created or drew
    from, and those in a local variable of any function a training micro-batch ran (seen as the function returns:
    a generator made inside `training_step`). Draws in loader workers change only the workers' copies of the
    dataset, so a generator drawn from there shows only with data.num_workers=0. Added to the check's runs after
    the template's callbacks: its `on_train_batch_start` sees the global generators just seeded.
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.before: dict[str, str] = {}
        self.in_steps: dict[str, Any] = {}  # name -> a generator held by a local variable in a training step
        self.seeded: dict[str, str] = {}
        self.global_drawn: set[str] = set()

    @staticmethod
    def _attributes(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        return {**own_generators(pl_module, "model"), **own_generators(trainer.datamodule, "data")}

    def _watch_locals(self, frame: FrameType, event: str, arg: Any) -> None:
        # The profile hook, on this thread during a training micro-batch: a generator made inside training_step
        # is held by a local variable, which no attribute reaches; it shows as its function returns.
        if event == "return":
            for var, value in frame.f_locals.items():
                if isinstance(value, GENERATOR_TYPES):
                    self.in_steps[f"{var} in {frame.f_code.co_name}()"] = value

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.before = {name: generator_state(g) for name, g in self._attributes(trainer, pl_module).items()}

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.seeded = global_states()
        sys.setprofile(self._watch_locals)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        sys.setprofile(None)
        after = global_states()
        self.global_drawn |= {name for name, state in after.items() if self.seeded[name] != state}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        found = self._attributes(trainer, pl_module)
        # a generator absent when training started was made during it (in training_step, say)
        drawn = [name for name, g in found.items() if self.before.get(name) != generator_state(g)]
        attributes = [id(g) for g in found.values()]
        drawn += [name for name, g in self.in_steps.items() if id(g) not in attributes]
        if trainer.is_global_zero:
            self.path.write_text(json.dumps({"own": drawn, "global": sorted(self.global_drawn)}))


def run_arguments(devices: int, accumulation: int, overrides: list[str], run_dir: Path) -> list[str]:
    """The arguments of `train.py` for one of the check's runs, on `devices` CPU processes, in `run_dir`."""
    return [
        *CHECK,
        *overrides,
        f"trainer.devices={devices}",
        *([f"trainer.accumulate_grad_batches={accumulation}"] if accumulation > 1 else []),
        f"+callbacks.held_layers._target_={MODULE}.{HeldLayers.__name__}",
        f"+callbacks.held_layers.path={run_dir / HELD}",
        f"+callbacks.drawn_generators._target_={MODULE}.{DrawnGenerators.__name__}",
        f"+callbacks.drawn_generators.path={run_dir / GENERATORS}",
        f"hydra.run.dir={run_dir}",
    ]


def start_run(devices: int, accumulation: int, overrides: list[str], run_dir: Path) -> subprocess.Popen:
    """`train.py` on `devices` CPU processes, in the background, its output in <run_dir>.out."""
    run_dir.mkdir(parents=True)
    command = [sys.executable, "train.py", *run_arguments(devices, accumulation, overrides, run_dir)]
    with open(run_dir.with_suffix(".out"), "w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)


def last_checkpoint(run_dir: Path) -> dict[str, Any]:
    """The state a run of the check ended with."""
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)


def finished_checkpoint(returncode: int, name: str, run_dir: Path) -> dict[str, Any] | None:
    """The run's last checkpoint, or None (with the end of its output shown) if it failed."""
    if returncode != 0:
        print(run_dir.with_suffix(".out").read_text()[-5000:], file=sys.stderr)
        print(f"error: the {describe(name)} run failed (above)", file=sys.stderr)
        return None
    return last_checkpoint(run_dir)


def manual_optimization(proc: subprocess.Popen, run_dir: Path) -> bool:
    """Whether the module steps its optimizers itself, as the plan that the run writes at its start records it (False
    where the run ends without one). Known within seconds, before the check says what it compares."""
    path = run_dir / "plan.json"
    while True:
        ended = proc.poll() is not None
        try:
            return bool(json.loads(path.read_text()).get("manual_optimization", False))
        except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or not whole yet
            if ended:
                return False
        time.sleep(0.1)


def what_is_compared(runs: dict[str, tuple[int, int]], precision: str) -> str:
    """The check's first line: the runs it compares, after how many steps, in which precision."""
    name = NAMES.get(precision, precision)
    if "1x2" not in runs:
        return f"comparing 2 CPU processes and 1 with the whole batch after {STEPS} steps in {name} ({NO_ACCUMULATION})"
    return (
        f"comparing 2 CPU processes, 1 accumulating 2 micro-batches and 1 with the whole batch after {STEPS} steps "
        f"in {name}"
    )


def describe(name: str) -> str:
    processes, accumulation = RUNS[name]
    return f"{processes}-process" + (f" accumulation-{accumulation}" if accumulation > 1 else "")


def comparison(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], precision: str, what: str) -> tuple[bool, str]:
    tolerance = TOLERANCE.get(precision, TOLERANCE["32-true"])
    differences = relative_differences(a, b)
    worst = max(differences, key=differences.get)
    line = f"{what}: largest relative difference {differences[worst]:.2e} ({worst}), tolerance {tolerance:g}"
    return differences[worst] <= tolerance, line


def split_advice(drawn: list[str] | tuple[str, ...]) -> str:
    """Why 2 processes differ from the same micro-batches on 1."""
    if drawn:
        return (
            f"training drew from generators of your own ({', '.join(drawn)}): seeded per process, not per sample, "
            "their numbers depend on the rank; draw from torch's global generator instead, which the template seeds "
            "per micro-batch and per sample (docs/randomness.md)"
        )
    return (
        "the same micro-batches give other weights or optimizer state on 2 processes: look for randomness of your "
        "own seeded per process (docs/randomness.md) and for a hand-made all_reduce that does not divide by the "
        "world size"
    )


SPLIT_DIFFERENCE = "splitting the batch into micro-batches changes the result"
MANUAL_DIFFERENCE = "the whole batch on 1 process and its halves on 2 give other weights or optimizer state"


def whole_batch_advice(
    randomness: list[str] | tuple[str, ...], difference: str = SPLIT_DIFFERENCE, parts: str = "its micro-batches"
) -> str:
    """Why the whole batch differs from its `parts`, BatchNorm and dropout layers being held (HeldLayers):
    `difference` in words."""
    if randomness:
        generators = f"{' and '.join(randomness)} global generator{'s' if len(randomness) > 1 else ''}"
        return (
            f"{difference}, and training steps drew from {generators} (randomness of your own: the check turns off "
            f"torch's dropout layers only), so a whole batch draws other numbers than {parts}. Turn that randomness "
            "off for the check with an override and run it again; if the runs still differ, check the loss is a "
            "mean over the device's batch, and that nothing divides by a global count."
        )
    return (
        f"{difference}. Check the loss is a mean over the device's batch, and that nothing divides by a global "
        "count (BatchNorm and dropout layers were held: they are not the cause)."
    )


def held_lines(held: dict[str, str]) -> list[str]:
    """The line that names the layers HeldLayers held, by class (none for a model without such layers)."""
    kinds: dict[str, list[str]] = {}
    for name, kind in held.items():
        kinds.setdefault(kind, []).append(name)
    named = [
        ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "") + f" ({kind})"
        for kind, names in kinds.items()
    ]
    why = "BatchNorm on fixed statistics, dropout off: a whole batch and its micro-batches compute alike"
    return [f"held in all three runs ({why}): {'; '.join(named)}"] if named else []


def verdict(
    checkpoints: dict[str, dict[str, Any]],
    precision: str,
    drawn: list[str] | tuple[str, ...] = (),
    randomness: list[str] | tuple[str, ...] = (),
    held: dict[str, str] | None = None,
) -> tuple[int, list[str]]:
    """(0 equivalent or 1 not, the lines to print) for the last checkpoints of the RUNS (or the MANUAL_RUNS: 2
    processes against the whole batch on 1, whose difference has either cause the accumulation run tells apart),
    the user's own generators that training drew from and the global generators that its steps drew from
    (`DrawnGenerators`), and the layers held (`HeldLayers`)."""
    name = NAMES.get(precision, precision)
    state = {run: compared_state(checkpoint) for run, checkpoint in checkpoints.items()}
    if "1x2" in state:
        rounding = " float32 rounding differs between CPUs: confirm in float64 (without --float32) first."
        checks = [
            (state["1x2"], state["2"], "2 processes vs 1 accumulating 2", split_advice(drawn)),
            (
                state["1"],
                state["1x2"],
                "1 process: whole batch vs 2 x half",
                whole_batch_advice(randomness) + (rounding if precision != "64-true" else ""),
            ),
        ]
    else:
        checks = [(state["1"], state["2"], "2 processes vs 1 with the whole batch", manual_advice(drawn, randomness))]
    compared = [(*comparison(a, b, precision, what), advice) for a, b, what, advice in checks]
    lines = [line for _, line, _ in compared] + held_lines(held or {})
    for same, _, advice in compared:
        if not same:
            return 1, [*lines, f"NOT EQUIVALENT in {name}: {advice}"]
    return 0, [*lines, f"EQUIVALENT in {name}: moving to more devices changes the speed, not the result"]


def manual_advice(drawn: list[str] | tuple[str, ...], randomness: list[str] | tuple[str, ...]) -> str:
    """Why the whole batch on 1 process differs from its halves on 2 under manual optimization (no accumulation run
    to tell the causes apart): the randomness training drew, as the automatic path names it, first."""
    if drawn:
        return split_advice(drawn)
    if randomness:
        return whole_batch_advice(randomness, MANUAL_DIFFERENCE, "its halves on 2 processes")
    return (
        f"{MANUAL_DIFFERENCE}. Check each loss is a mean over the device's batch and nothing divides by a global "
        "count; look for randomness of your own (docs/randomness.md) and for a hand-made all_reduce that does not "
        "divide by the world size"
    )


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
    with tempfile.TemporaryDirectory() as tmp:
        run_dirs = {name: Path(tmp) / name for name in RUNS}
        procs = {name: start_run(*RUNS[name], overrides, run_dirs[name]) for name in RUNS}  # side by side
        # Known from the module, in the plan a run writes at its start: under manual optimization the accumulation
        # run is refused at start-up (one line), and the other two are compared. (Waiting for a plan before starting
        # the accumulation run made the check 50% slower on 2 cores.)
        runs = MANUAL_RUNS if manual_optimization(procs["1"], run_dirs["1"]) else RUNS
        print(what_is_compared(runs, precision), flush=True)
        codes = {name: proc.wait() for name, proc in procs.items()}
        checkpoints = {name: finished_checkpoint(codes[name], name, run_dirs[name]) for name in runs}
        if any(checkpoint is None for checkpoint in checkpoints.values()):
            return 2
        plans = {name: Plan.from_dict(json.loads((run_dirs[name] / "plan.json").read_text())) for name in runs}
        ran = {name: (plans[name].world_size, plans[name].accumulate_grad_batches) for name in runs}
        if ran != runs:  # e.g. a config of the user's that sets the accumulation or the device count its own way
            print(f"error: the runs were meant as (processes, accumulation) {runs} but ran as {ran}", file=sys.stderr)
            return 2
        generators = json.loads((run_dirs["2"] / GENERATORS).read_text())
        held = json.loads((run_dirs["2"] / HELD).read_text())
    code, lines = verdict(checkpoints, precision, generators["own"], generators["global"], held)
    print("\n".join(lines))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
