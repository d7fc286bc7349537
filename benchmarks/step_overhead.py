"""Per-step overhead at steps small enough that the framework, not the model, sets the pace: digits (8x8), DigitsCNN
width 32, batch 16, one torch thread, CPU. About 7 ms a step, the range of GPU steps, where a few hundred us of
Python per step show. Each part can run alone with `--only`; they run in this order:

Two baselines, as "bare Lightning" can mean either:
- bare Lightning (`Bare`): the same network, loss, optimizer and data in a LightningModule that logs nothing, on a
  Trainer with no progress bar, logger or checkpoint: Lightning's own floor;
- Lightning as its users have it (`--variant lightning-user`): train.py's LightningModule itself (ImageClassifier,
  its metrics and logging) on a Trainer with Lightning's defaults (its TQDM bar, TensorBoard, a ModelCheckpoint)
  and train.py's log_every_n_steps: what train.py adds to a Lightning script of one's own with the same module.

1. `lockstep`, where the ratios are read: `python train.py` as users run it (progress bar, TensorBoard, LR
   monitor, diagnostics, checkpoints, metrics) against each baseline, with the same data, network and optimizer,
   run at the same time as two processes that take turns step by step (a pipe passes the turn at each step's end),
   so a machine getting busier or quieter slows both alike, step for step. The process that leads (and starts
   first) alternates between pairs; a pair of bare Lightning against itself shows the method's own noise. Each process
   times the 73 steps after the first 5 of each of 3 epochs (78 steps each), logging steps included, validation
   between epochs not, in CPU time of all its threads (the helper threads' work counts; the progress bar's
   drawing, paced by the clock, counts up to twice, as a step takes twice as long in lockstep). Printed per pair:
   CPU ms per step and their ratio, and the median ratio of windows of train.py's log_every_n_steps steps (one
   logging step each); over the pairs, the geometric mean (which cancels what leading does, with an even number
   of pairs) and the median, and train.py's extra us in ordinary and in logging steps.
2. `hooks`: inside train.py's steps, each callback's step hooks, the module's metric updates and log calls and the
   loggers' writes, timed with the main thread's CPU clock (HookTimer): what each piece costs in a real step.
3. `variants`: in alternating fresh processes, a plain PyTorch loop, bare Lightning and train.py, each run alone:
   median, min and spread of the runs' mean s/step (wall and CPU), and each one's ratio to bare Lightning.
4. `calls`: the main thread's Python calls per step, each baseline and train.py (CallCounter): a count, the same
   under any load.
5. `parts`, in one process: bare Lightning plus one part (a callback of train.py or of the default callbacks, the
   TensorBoard logger, or the template's LightningModule with its metrics and logging), each against bare
   Lightning alone, in alternating rounds (219 steps timed). Printed: the extra ms per step of each part and its
   share of bare Lightning's step, and, timed alone, the diagnostics' hooks and what Lightning's dispatch spends
   on a callback that does nothing in a step.
6. `versus`, only on request (`--only versus --versus DIR`): train.py of this checkout against train.py of another
   checkout of the project (`git worktree add DIR REV`), in lockstep like part 1: what a change does to the step.

    python benchmarks/step_overhead.py [--pairs 6] [--repeats 5] [--rounds 3] [--override KEY=VALUE ...] [--json FILE]
    python benchmarks/step_overhead.py --only versus --versus ../main-before [--pairs 16]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import (
    LearningRateMonitor,
    ModelCheckpoint,
    ProgressBar,
    RichProgressBar,
    TQDMProgressBar,
)
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer import call
from torch.utils.data import ConcatDataset, DataLoader

from myproject.data import DigitsDataModule
from myproject.models import DigitsCNN, ImageClassifier
from overhead import (
    STEP_TIMES,
    StepTimer,
    compare,
    diagnostics_seconds_per_step,
    now,
    numbers_after,
    plain_loop,
    printed_numbers,
    seconds_per_step,
)
from scaleup.callbacks.diagnostics import TrainingDiagnostics
from scaleup.callbacks.exact_metrics import ExactEvalMetrics
from scaleup.callbacks.loop_repairs import LoopRepairs
from scaleup.callbacks.lr_scaling import LRScaling
from scaleup.callbacks.preemption import JobControl
from scaleup.callbacks.run_files import RunFiles
from scaleup.callbacks.step_plan import StepPlan
from scaleup.callbacks.step_seed import StepSeed
from scaleup.observability.figures import ClassificationFigures
from scaleup.observability.metrics import StageMetrics
from scaleup.optim import build_optimizer
from scaleup.plan.lr import LRSchedule
from scaleup.plan.resolve import resolve_log_every_n_steps

ROOT = Path(__file__).resolve().parents[1]
BATCH, WARMUP, STEPS, EPOCHS = 16, 5, 73, 3  # 1,257 training digits: 78 steps of 16 in an epoch
SGD = {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4, "nesterov": True}
NET = {"_target_": "myproject.models.DigitsCNN", "num_classes": 10, "in_channels": 1, "width": 32}
# Rich draws as it would in a terminal (the output goes to a pipe here), where it costs what users pay.
TERMINAL = {"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1", "COLUMNS": "120"}
USER = "Lightning as users have it"  # the second baseline (user_lightning)


def digits_loader(repeat: int = 1) -> DataLoader:
    """The training digits in batches of 16, `repeat` times over in one epoch."""
    datamodule = DigitsDataModule(global_batch_size=BATCH)
    datamodule.setup()
    torch.manual_seed(0)
    data = ConcatDataset([datamodule.splits["train"]] * repeat)
    return DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True)


class Bare(L.LightningModule):
    """The network, loss and optimizer of train.py's default model, nothing logged."""

    def __init__(self) -> None:
        super().__init__()
        self.net = DigitsCNN(num_classes=10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return build_optimizer(SGD, self)


def run_plain() -> None:
    net = DigitsCNN(num_classes=10)
    plain_loop(digits_loader(), net, build_optimizer(SGD, net), epochs=EPOCHS)


def bare_trainer(callbacks: list[L.Callback], logger: Any = False, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_epochs=EPOCHS,
        logger=logger,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=any(isinstance(c, ProgressBar) for c in callbacks),
        enable_model_summary=False,
        callbacks=callbacks,
        **kwargs,
    )


def user_lightning(callbacks: list[L.Callback]) -> None:
    """Lightning as its users have it: train.py's LightningModule (ImageClassifier: the same network, optimizer,
    metrics and logging) on a Trainer with Lightning's defaults (TQDMProgressBar, TensorBoardLogger, a
    ModelCheckpoint) and train.py's log_every_n_steps, plus `callbacks`."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(
            accelerator="cpu",
            max_epochs=EPOCHS,
            logger=TensorBoardLogger(tmp, name="tb"),
            default_root_dir=tmp,
            enable_model_summary=False,
            log_every_n_steps=resolve_log_every_n_steps("auto", WARMUP + STEPS),
            callbacks=callbacks,
        )
        trainer.fit(ImageClassifier(NET, SGD), digits_loader())


def run_lightning(args: argparse.Namespace) -> None:
    """`--variant lightning` (bare Lightning) or `lightning-user` (Lightning as its users have it), measured by the
    step timer, in lockstep (given the pipes) or by the call counter (`--count`)."""
    if args.receive:
        measure: L.Callback = Lockstep(args.receive, args.send, args.first == "True")
    else:
        measure = CallCounter() if args.count else StepTimer()
    if args.variant == "lightning":
        bare_trainer([measure]).fit(Bare(), digits_loader())
    else:
        user_lightning([measure])


class Lockstep(StepTimer):
    """StepTimer in a pair of processes taking turns: after each of its first `steps` steps it hands the turn over
    on the pipe `send` and waits for it on `receive`. The process that is not `first` waits for the turn before
    its first step."""

    def __init__(self, receive: str, send: str, first: bool, steps: int = EPOCHS * (WARMUP + STEPS)) -> None:
        super().__init__()
        # Read-write opens of a FIFO do not wait for the other end (Linux): both processes can open both pipes.
        self.receive, self.send = os.open(receive, os.O_RDWR), os.open(send, os.O_RDWR)
        self.first, self.steps = first, steps

    def on_train_start(self, trainer, pl_module) -> None:
        if not self.first:
            os.read(self.receive, 1)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        taken = len(self.times) // 2
        if taken <= self.steps:
            os.write(self.send, b"x")
            if taken < self.steps:  # after its last step, the other process takes its own without waiting
                os.read(self.receive, 1)

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        print(LOG_EVERY, trainer.log_every_n_steps, file=sys.__stdout__, flush=True)


def template_command(run_dir: str, overrides: list[str], callback: str = "overhead.StepTimer") -> list[str]:
    """train.py with its defaults: only the batch, the epochs and CPU set, and the step timer (or `callback`)."""
    return [
        sys.executable,
        "train.py",
        f"data.global_batch_size={BATCH}",
        f"trainer.max_epochs={EPOCHS}",
        "trainer.accelerator=cpu",
        f"+callbacks.measure._target_={callback}",
        f"hydra.run.dir={run_dir}",
        "fresh_start=true",  # a pair that runs again (too few step times) starts over in its scratch directory
        *overrides,
    ]


# --- Python calls per step: a count, the same on every machine ------------------------------------------------------

CALLS = "PYTHON_CALLS"
COUNTED = range(20, 50)  # 30 steps of the first epoch; with train.py's log_every_n_steps (auto: 19), 2 log


class CallCounter(L.Callback):
    """Counts the main thread's Python-level calls (of Python functions, and of C functions from Python) in each
    `COUNTED` training step with `sys.setprofile`, from the end of the step before to this callback's hook, and
    prints the counts when training ends. Unlike times, counts do not move with the machine's load."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self._count = self._step = 0

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            self._count += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if sys.getprofile() is not None:  # this step was counted
            sys.setprofile(None)
            self.calls.append(self._count)
            self._count = 0
        self._step += 1
        if self._step in COUNTED:
            sys.setprofile(self._profile)

    def on_train_end(self, trainer, pl_module) -> None:
        print(CALLS, *self.calls, file=sys.__stdout__, flush=True)


def count_calls(args: argparse.Namespace, env: dict[str, str], itself: list[str]) -> dict[str, Any]:
    """Python calls per training step of each baseline and of train.py, one run each."""
    with tempfile.TemporaryDirectory() as tmp:
        commands = {
            "bare Lightning": [*itself, "lightning", "--count"],
            USER: [*itself, "lightning-user", "--count"],
            "train.py": template_command(f"{tmp}/run", args.override, callback="step_overhead.CallCounter"),
        }
        counts = {name: [int(n) for n in printed_numbers(command, env, CALLS)] for name, command in commands.items()}
    mean = {name: statistics.fmean(calls) for name, calls in counts.items()}
    steps = f"steps {COUNTED.start}-{COUNTED.stop - 1}, logging steps included"
    print(f"\nPython calls per training step, main thread, {steps}")
    for name, calls in counts.items():
        row = f"mean {mean[name]:7.0f}, ordinary step {min(calls):6d}, logging step {max(calls):6d}"
        print(f"{name:26s} {row}   x bare Lightning {mean[name] / mean['bare Lightning']:.3f}")
    ratios = {"ratio": mean["train.py"] / mean["bare Lightning"], "ratio_to_user": mean["train.py"] / mean[USER]}
    print(f"train.py x {USER}: {ratios['ratio_to_user']:.3f}")
    return {"per_step": counts, "mean": mean} | ratios


# --- Each piece's CPU time inside a training step ------------------------------------------------------------------

HOOK_TIMES = "HOOK_TIMES"
LOG_EVERY = "LOG_EVERY"
TIMED_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
               "on_before_zero_grad", "on_train_batch_end")  # fmt: skip


class HookTimer(L.Callback):
    """Times, with the main thread's CPU clock, every step hook of every other callback, the module's metric updates
    and `log` calls and the loggers' writes, inside the training steps of the epochs after the first (the first
    of each epoch not counted: it hands the metric objects to Lightning), and prints each one's microseconds per
    step when training ends. Inside a real step a piece costs more than in a loop of its own, where its code and
    data stay in the caches."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.steps = 0
        self._on = False

    def _time(self, owner: Any, attribute: str, name: str) -> None:
        call = getattr(owner, attribute)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self._on:
                return call(*args, **kwargs)
            start = time.thread_time()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.thread_time() - start

        setattr(owner, attribute, timed)  # an instance attribute: Lightning's dispatch finds it

    def on_fit_start(self, trainer, pl_module) -> None:
        for callback in trainer.callbacks:
            for hook in TIMED_HOOKS:
                if callback is not self and getattr(type(callback), hook) is not getattr(L.Callback, hook):
                    self._time(callback, hook, f"{type(callback).__name__}.{hook}")
        if isinstance(getattr(pl_module, "metrics", None), StageMetrics):
            self._time(pl_module.metrics, "update", "StageMetrics.update")
            self._time(pl_module.metrics, "log", "StageMetrics.log")
        self._time(pl_module, "log", "LightningModule.log")
        for logger in trainer.loggers:
            self._time(logger, "log_metrics", f"{type(logger).__name__}.log_metrics")
            self._time(logger, "save", f"{type(logger).__name__}.save")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._on = trainer.current_epoch > 0 and batch_idx > 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps += self._on

    def on_train_end(self, trainer, pl_module) -> None:
        times = [f"{name}={seconds / max(self.steps, 1)}" for name, seconds in self.seconds.items()]
        print(HOOK_TIMES, *times, file=sys.__stdout__, flush=True)


def time_hooks(args: argparse.Namespace, env: dict[str, str]) -> dict[str, float]:
    """train.py with HookTimer, `args.repeats` runs: each piece's median microseconds per step."""
    runs: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            command = template_command(f"{tmp}/run{i}", args.override, callback="step_overhead.HookTimer")
            out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"{' '.join(command)} failed:\n{out.stderr[-4000:]}")
            line = next(line for line in out.stdout.splitlines() if HOOK_TIMES in line)
            for item in line[line.index(HOOK_TIMES) :].split()[1:]:
                name, seconds = item.split("=")
                runs.setdefault(name, []).append(float(seconds) * 1e6)
    costs = {name: statistics.median(us) for name, us in runs.items()}
    print(f"\ninside train.py's steps, main thread CPU time, median of {args.repeats} runs (us per step)")
    for name, us in sorted(costs.items(), key=lambda item: -item[1]):
        print(f"{us:8.1f}  {name}")
    return costs


class StopTiming(Exception):
    """Raised after the timed steps of a part: no epoch end, validation or checkpoint is timed."""


class PartTimer(L.Callback):
    """Wall and CPU seconds per step over the `STEPS` steps after `WARMUP` of one epoch, then stops the fit."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.marks.append(now())
        if len(self.marks) == WARMUP + STEPS:
            raise StopTiming

    def per_step(self) -> dict[str, float]:
        (wall0, cpu0), (wall1, cpu1) = self.marks[WARMUP - 1], self.marks[-1]
        return {"wall": (wall1 - wall0) / STEPS, "cpu": (cpu1 - cpu0) / STEPS}


def parts(tmp: Path) -> dict[str, Callable[[], tuple[L.LightningModule, list[L.Callback], Any]]]:
    """Each part as (module, extra callbacks, logger), built fresh for every timed run."""
    schedule = LRSchedule(peak=0.25, warmup_steps=0, total_steps=936)  # batch 16 of base 64: below it, no warmup

    def callback(make: Callable[[], L.Callback]):
        return lambda: (Bare(), [make()], False)

    def tensorboard() -> TensorBoardLogger:
        return TensorBoardLogger(tmp, name="tb", version="", default_hp_metric=False)

    template = {  # train.py's own callbacks (build_trainer), in its order
        "StepPlan": lambda: StepPlan(True, False, LRScaling(schedule), StepSeed(42, BATCH)),
        "ExactEvalMetrics": ExactEvalMetrics,
        "LoopRepairs": LoopRepairs,
        "RunFiles": lambda: RunFiles(tmp / "metrics.json", None, None),
        "JobControl": lambda: JobControl(tmp / "ckpt", stop_on_nonfinite_loss=True),  # train.py's default
    }
    defaults = {  # engine/src/scaleup/conf/callbacks/default.yaml
        "ModelCheckpoint (best)": lambda: ModelCheckpoint(tmp / "ckpt", monitor="val/acc", mode="max"),
        "ModelCheckpoint (last)": lambda: ModelCheckpoint(tmp / "ckpt", filename="last"),
        "TrainingDiagnostics": TrainingDiagnostics,
        "RichProgressBar(refresh_rate=4)": lambda: RichProgressBar(refresh_rate=4),
        "TQDMProgressBar (Lightning's default)": TQDMProgressBar,
        "ClassificationFigures (the classifier's)": ClassificationFigures,
    }
    table = {"bare Lightning": lambda: (Bare(), [], False)}
    table |= {name: callback(make) for name, make in (template | defaults).items()}
    table |= {
        "TensorBoard logger": lambda: (Bare(), [], tensorboard()),
        "LearningRateMonitor (+ TensorBoard)": lambda: (Bare(), [LearningRateMonitor("step")], tensorboard()),
        "ImageClassifier (metrics, logging)": lambda: (ImageClassifier(NET, SGD), [], False),
        "all of train.py's own callbacks": lambda: (Bare(), [make() for make in template.values()], False),
    }

    def everything(bar: str) -> Callable[[], tuple[L.LightningModule, list[L.Callback], Any]]:
        """What train.py puts together (its model, its callbacks, the default ones with `bar`, TensorBoard)."""
        config = [name for name in defaults if "ProgressBar" not in name]
        return lambda: (
            ImageClassifier(NET, SGD),
            [
                *(make() for make in template.values()),
                *(defaults[name]() for name in config),
                LearningRateMonitor("step"),
                defaults[bar](),
            ],
            tensorboard(),
        )

    table["all of it, RichProgressBar(refresh_rate=4)"] = everything("RichProgressBar(refresh_rate=4)")
    table["all of it, TQDMProgressBar"] = everything("TQDMProgressBar (Lightning's default)")
    return table


def time_part(make: Callable[[], tuple[L.LightningModule, list[L.Callback], Any]]) -> dict[str, float]:
    """One part's seconds per step."""
    module, callbacks, logger = make()
    timer = PartTimer()
    # Logging steps as often as in train.py (its `auto` on an epoch of 78 steps).
    every = resolve_log_every_n_steps("auto", WARMUP + STEPS)
    trainer = bare_trainer([*callbacks, timer], logger=logger, log_every_n_steps=every)
    with contextlib.suppress(StopTiming):
        trainer.fit(module, digits_loader())
    if logger:
        logger.finalize("success")  # its writer thread stops: nothing left running into the next timing
    gc.collect()
    return timer.per_step()


def run_parts(rounds: int, out: Path) -> None:
    """Each part timed next to its own bare Lightning run (bare first in even rounds, the part first in odd ones,
    so a machine getting busier or the process aging cancels out), `rounds` times; writes the per-step seconds
    of both to `out` as JSON."""
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        table = parts(Path(tmp))
        bare = table.pop("bare Lightning")
        time_part(bare)  # imports and first-call costs, untimed
        for i in range(rounds):
            for name, make in table.items():
                if i % 2 == 0:
                    reference, part = time_part(bare), time_part(make)
                else:
                    part, reference = time_part(make), time_part(bare)
                results.setdefault(name, []).append(part | {f"bare_{k}": v for k, v in reference.items()})
    out.write_text(json.dumps(results))


def part_costs(results: dict[str, list[dict[str, float]]], clock: str) -> dict[str, dict[str, float]]:
    """Each part's extra seconds per step over its paired bare Lightning run, median over rounds."""
    costs = {}
    for name, runs in results.items():
        extra = [r[clock] - r[f"bare_{clock}"] for r in runs]
        bare = statistics.median(r[f"bare_{clock}"] for r in runs)
        costs[name] = {"extra_s": statistics.median(extra), "min_s": min(extra), "max_s": max(extra)}
        costs[name]["share_of_bare"] = costs[name]["extra_s"] / bare
    return costs


def print_parts(costs: dict[str, dict[str, float]], bare: float, clock: str) -> None:
    print(f"\nper-step cost of each part over bare Lightning ({bare * 1e3:.2f} ms/step), {clock} time")
    print(f"{'':38s} {'extra ms/step':>13s} {'range':>15s} {'of bare':>8s}")
    for name, row in costs.items():
        spread = f"{row['min_s'] * 1e3:+.2f}..{row['max_s'] * 1e3:+.2f}"
        print(f"{name:38s} {row['extra_s'] * 1e3:+13.3f} {spread:>15s} {row['share_of_bare']:+8.1%}")


STEP_HOOKS = {  # the callback hooks Lightning calls in every training step, with their arguments after the module
    "on_train_batch_start": (None, 0),
    "on_before_backward": (None,),
    "on_after_backward": (),
    "on_before_optimizer_step": (None,),
    "on_before_zero_grad": (None,),
    "on_train_batch_end": (None, None, 0),
}


def dispatch_seconds_per_callback(repeats: int = 2_000) -> float:
    """What Lightning's dispatch spends per training step on one callback that overrides nothing: it calls each
    step hook on every callback, inside a profiler context named after the callback's state key."""
    timings = {}
    for count in (0, 20):
        trainer = bare_trainer([L.Callback() for _ in range(count)])  # callbacks that override no hook
        trainer.strategy.connect(Bare())
        start = time.perf_counter()
        for _ in range(repeats):
            for hook, args in STEP_HOOKS.items():
                call._call_callback_hooks(trainer, hook, *args)
        timings[count] = (time.perf_counter() - start) / repeats
    return (timings[20] - timings[0]) / 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="alternating runs of each variant")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds over the parts")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--pairs", type=int, default=6, help="lockstep pairs of each comparison")
    parts = ["lockstep", "hooks", "variants", "calls", "parts", "versus"]
    parser.add_argument("--only", choices=parts, help="run one part of the benchmark")
    parser.add_argument("--versus", type=Path, help="another checkout of the project, for --only versus")
    parser.add_argument("--override", action="append", default=[], help="a train.py override (repeatable)")
    variants = ["lightning", "lightning-user", "plain", "parts"]
    parser.add_argument("--variant", choices=variants, help=argparse.SUPPRESS)  # internal
    parser.add_argument("--count", action="store_true", help=argparse.SUPPRESS)  # count calls, not time
    parser.add_argument("--parts-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--receive", help=argparse.SUPPRESS)  # lockstep: the pipes and who takes the first step
    parser.add_argument("--send", help=argparse.SUPPRESS)
    parser.add_argument("--first", choices=["True", "False"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if (args.only == "versus") != (args.versus is not None):
        parser.error("--only versus and --versus DIR go together")
    if args.variant:
        torch.set_num_threads(1)
        if args.variant == "parts":
            run_parts(args.rounds, args.parts_out)
        elif args.variant == "plain":
            run_plain()
        else:
            run_lightning(args)
        return

    env = {
        **os.environ,
        **TERMINAL,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")]),
    }
    itself = [sys.executable, str(Path(__file__).resolve()), "--variant"]
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "load_average": {}}
    report["config"] = {"batch": BATCH, "warmup": WARMUP, "steps": STEPS, "epochs": EPOCHS} | vars(args)
    report["config"] |= {"json": str(args.json), "threads": 1}
    report["load_average"]["start"] = os.getloadavg()
    if args.only in (None, "lockstep"):
        report["lockstep"] = compare_in_lockstep(args, env, itself)
        report["load_average"]["after_lockstep"] = os.getloadavg()
    if args.only in (None, "hooks"):
        report["hooks_us_per_step"] = time_hooks(args, env)
    if args.only in (None, "variants"):
        report["variants"] = compare_variants(args, env, itself)
        report["load_average"]["after_variants"] = os.getloadavg()
    if args.only in (None, "calls"):
        report["python_calls"] = count_calls(args, env, itself)
    if args.only in (None, "parts"):
        report["parts"] = compare_parts(args, env, itself)
        report["load_average"]["end"] = os.getloadavg()
    if args.only == "versus":
        report["versus"] = compare_checkouts(args, env)
    print(f"\nload average (1, 5, 15 min): {report['load_average']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")


def compare_variants(args: argparse.Namespace, env: dict[str, str], itself: list[str]) -> dict[str, Any]:
    """plain loop, bare Lightning and train.py, alternating, each run a fresh process."""
    results: dict[str, list[dict[str, float]]] = {"plain loop": [], "bare Lightning": [], "train.py": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            commands = {
                "plain loop": [*itself, "plain"],
                "bare Lightning": [*itself, "lightning"],
                "train.py": template_command(f"{tmp}/run{i}", args.override),
            }
            for name, command in commands.items():
                results[name].append(seconds_per_step(command, env, WARMUP, STEPS, epochs=EPOCHS))
                last = results[name][-1]
                print(f"  run {i + 1}/{args.repeats} {name:15s} {last['wall'] * 1e3:.2f} ms/step wall")
    print(
        f"\ndigits, DigitsCNN width 32, batch {BATCH}, CPU, 1 thread; {STEPS} steps after {WARMUP} in each of {EPOCHS}"
        f" epochs, {args.repeats} alternating runs; train.py overrides: {args.override or 'none'}"
    )
    return {
        clock: compare({name: [r[clock] for r in runs] for name, runs in results.items()}, clock, "bare Lightning")
        for clock in ("wall", "cpu")
    }


def timed_steps() -> list[int]:
    """Indices of the timed steps (each step's time ends at its own mark, starts at the one before)."""
    return [e * (WARMUP + STEPS) + k for e in range(EPOCHS) for k in range(WARMUP, WARMUP + STEPS)]


def lockstep_pair(
    commands: dict[str, list[str]], lead: str, env: dict[str, str], tmp: str
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Runs the two commands (name: command with the Lockstep callback's pipes still to add) in lockstep, `lead`
    started first and taking the first step; returns each one's CPU time at the end of every step, and its
    Trainer's log_every_n_steps."""
    receive = {name: f"{tmp}/to-{i}" for i, name in enumerate(commands)}
    for path in receive.values():
        os.mkfifo(path)
    (a, b), procs, outputs = commands, {}, {}
    for name in sorted(commands, key=lambda n: n != lead):
        other = b if name == a else a
        pipes = {"receive": receive[name], "send": receive[other], "first": name == lead}
        command = [arg.format(**pipes) for arg in commands[name]]
        # Output to files, not pipes: a process is watched, not read, while its partner runs.
        outputs[name] = [open(f"{tmp}/{name}.{kind}", "w+") for kind in ("out", "err")]  # noqa: SIM115
        procs[name] = subprocess.Popen(command, cwd=ROOT, env=env, stdout=outputs[name][0], stderr=outputs[name][1])
    while any(proc.poll() is None for proc in procs.values()):
        if any(proc.returncode for proc in procs.values()):  # its partner would wait for its turn for ever
            for proc in procs.values():
                proc.kill()
        time.sleep(0.2)
    printed = {}
    for name, files in outputs.items():
        printed[name] = [file.seek(0) or file.read() for file in files]
        for file in files:
            file.close()
    if failed := sorted((proc.returncode == -9, name) for name, proc in procs.items() if proc.returncode):
        name = failed[0][1]  # the one that failed, not its partner killed after it
        raise SystemExit(f"{name} failed:\n{printed[name][0][-2000:]}\n{printed[name][1][-4000:]}")
    times, log_every = {}, {}
    for name, (out, _) in printed.items():
        numbers = {marker: numbers_after(out, marker) for marker in (STEP_TIMES, LOG_EVERY)}
        times[name], log_every[name] = numbers[STEP_TIMES][1::2], int(numbers[LOG_EVERY][0])  # the CPU times
    for path in receive.values():
        os.unlink(path)
    if short := {name: len(t) for name, t in times.items() if len(t) < EPOCHS * (WARMUP + STEPS)}:
        # Seen once in about a hundred pairs: a process printed fewer step times than it took steps.
        raise IncompletePair(f"fewer step times than steps: {short}")
    return times, log_every


class IncompletePair(RuntimeError):
    pass


def lockstep_pair_retried(
    commands: dict[str, list[str]], lead: str, env: dict[str, str], tmp: str
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """`lockstep_pair`, run once more if a process's step times came back incomplete."""
    try:
        return lockstep_pair(commands, lead, env, tmp)
    except IncompletePair as error:
        print(f"  {error}: the pair runs again")
        return lockstep_pair(commands, lead, env, tmp)


def pair_ratios(times: dict[str, list[float]], reference: str, other: str, log_every: int) -> dict[str, Any]:
    """`other` over `reference`: mean CPU s/step over the timed steps, the median ratio of windows of `log_every`
    steps (each holds one logging step), and the per-step differences of ordinary and of logging steps (step k,
    0-based over the epochs, logs when (k + 1) % log_every == 0)."""
    steps = timed_steps()

    def step(name: str, k: int) -> float:
        return times[name][k] - times[name][k - 1]

    mean = {name: statistics.fmean(step(name, k) for k in steps) for name in (reference, other)}
    windows = [steps[i : i + log_every] for i in range(0, len(steps) - log_every + 1, log_every)]
    window_ratios = [sum(step(other, k) for k in w) / sum(step(reference, k) for k in w) for w in windows]
    extra = {
        kind: statistics.median(
            step(other, k) - step(reference, k) for k in steps if ((k + 1) % log_every == 0) == logging
        )
        for kind, logging in (("ordinary", False), ("logging", True))
    }
    return {
        "s_per_step": mean,
        "ratio": mean[other] / mean[reference],
        "window_ratio": statistics.median(window_ratios),
        "extra_s": extra,
    }


# The Lockstep callback's arguments, filled in by lockstep_pair: for the bare Lightning variant, and through Hydra.
PIPES = ["--receive", "{receive}", "--send", "{send}", "--first", "{first}"]
HYDRA_PIPES = [f"+callbacks.measure.{key}={{{key}}}" for key in ("receive", "send", "first")]


def compare_checkouts(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """train.py of this checkout against train.py of the checkout `args.versus`, in lockstep, `args.pairs` times:
    what a change does to the step, without bare Lightning's noise in between."""

    def command(root: Path, run_dir: str) -> list[str]:
        train = template_command(run_dir, args.override, callback="step_overhead.Lockstep")
        train[1] = str(root / "train.py")
        # Each side imports its own engine and package; the Lockstep callback comes from this file.
        path = os.pathsep.join(str(p) for p in (root / "engine" / "src", root / "src", ROOT / "benchmarks"))
        return ["env", f"PYTHONPATH={path}", *train, *HYDRA_PIPES]

    versus, runs = args.versus.resolve(), []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            commands = {"bare": command(versus, f"{tmp}/versus{i}"), "this": command(ROOT, f"{tmp}/this{i}")}
            lead = list(commands)[i % 2]
            times, log_every = lockstep_pair_retried(commands, lead, env, tmp)
            runs.append(pair_ratios(times, "bare", "this", log_every["this"]) | {"lead": lead})
            print(f"  pair {i + 1}/{args.pairs}: this checkout x {args.versus}: {runs[-1]['ratio']:.3f}")
    summary = {
        "versus": str(args.versus),
        "ratio": statistics.geometric_mean(r["ratio"] for r in runs),
        "median_ratio": statistics.median(r["ratio"] for r in runs),
        "pairs": runs,
    }
    print(
        f"\nin lockstep, CPU time, {args.pairs} pairs: this checkout's train.py x {args.versus}'s:"
        f" {summary['ratio']:.3f} (geometric mean; median {summary['median_ratio']:.3f})"
    )
    return summary


def compare_in_lockstep(args: argparse.Namespace, env: dict[str, str], itself: list[str]) -> dict[str, Any]:
    """train.py against bare Lightning and against Lightning as its users have it, and bare Lightning against
    itself, each pair in lockstep, `args.pairs` times."""
    results: dict[str, list[dict[str, Any]]] = {"train.py": [], f"train.py x {USER}": [], "bare Lightning (itself)": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            # train.py in a run directory of its own for each pair: a new run into one that holds a run is refused
            lockstep = "step_overhead.Lockstep"
            template = [
                [*template_command(f"{tmp}/run{i}-{pair}", args.override, callback=lockstep), *HYDRA_PIPES]
                for pair in range(2)
            ]
            pairs = {  # each: (the reference, the other)
                "train.py": {"bare": [*itself, "lightning", *PIPES], "train.py": template[0]},
                f"train.py x {USER}": {"user": [*itself, "lightning-user", *PIPES], "train.py": template[1]},
                "bare Lightning (itself)": {
                    "bare": [*itself, "lightning", *PIPES],
                    "again": [*itself, "lightning", *PIPES],
                },
            }
            for name, commands in pairs.items():
                lead = list(commands)[i % 2]  # who leads, and starts first, alternates
                times, log_every = lockstep_pair_retried(commands, lead, env, tmp)
                if "train.py" in log_every:  # bare Lightning against itself is cut into train.py's windows
                    every = log_every["train.py"]
                reference, other = commands
                ratios = pair_ratios(times, reference, other, every)
                results[name].append(ratios | {"lead": lead})
                ms = " vs ".join(f"{v * 1e3:.2f}" for v in ratios["s_per_step"].values())
                row = f"{ratios['ratio']:.3f}, windows {ratios['window_ratio']:.3f}"
                print(f"  pair {i + 1}/{args.pairs} {name:38s} ms/step {ms}: {row}")
    print(f"\nin lockstep, CPU time, {args.pairs} pairs; train.py overrides: {args.override or 'none'}")
    summary = {}
    for name, runs in results.items():
        # The geometric mean over pairs that lead in turn cancels what leading does to a process (the core it
        # lands on, starting first): one pair in two has each lead.
        summary[name] = {
            "ratio": statistics.geometric_mean(r["ratio"] for r in runs),
            "median_ratio": statistics.median(r["ratio"] for r in runs),
            "window_ratio": statistics.geometric_mean(r["window_ratio"] for r in runs),
            "extra_us": {
                kind: statistics.median(r["extra_s"][kind] for r in runs) * 1e6 for kind in ("ordinary", "logging")
            },
            "pairs": runs,
        }
        row = summary[name]
        versus = "" if "x" in name.split() else " x bare Lightning"
        print(
            f"{name + versus:38s}: {row['ratio']:.3f} (geometric mean of the pairs; median"
            f" {row['median_ratio']:.3f}), windows {row['window_ratio']:.3f}; extra us in an ordinary step"
            f" {row['extra_us']['ordinary']:+.0f}, in a logging step {row['extra_us']['logging']:+.0f}"
        )
    return summary


def compare_parts(args: argparse.Namespace, env: dict[str, str], itself: list[str]) -> dict[str, Any]:
    """Each part against bare Lightning in one fresh process; the diagnostics' hooks and Lightning's per-callback
    dispatch timed alone."""
    with tempfile.TemporaryDirectory() as tmp:
        parts_out = Path(tmp) / "parts.json"
        command = [*itself, "parts", "--rounds", str(args.rounds), "--parts-out", str(parts_out)]
        out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"parts failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
        runs = json.loads(parts_out.read_text())
    costs = {}
    for clock in ("wall", "cpu"):
        costs[clock] = part_costs(runs, clock)
        print_parts(costs[clock], statistics.median(r[f"bare_{clock}"] for rs in runs.values() for r in rs), clock)
    bare = statistics.median(r["bare_wall"] for rs in runs.values() for r in rs)
    hooks = diagnostics_seconds_per_step(BATCH)
    dispatch = dispatch_seconds_per_callback()
    print(f"\nTrainingDiagnostics hooks alone: {hooks * 1e6:.1f} us per step = {hooks / bare:.3%} of the bare step")
    print(
        f"Lightning's dispatch, per idle callback: {dispatch * 1e6:.2f} us per step = {dispatch / bare:.3%} of a step"
    )
    return {
        "runs": runs,
        "cost_over_bare_lightning": costs,
        "diagnostics_hooks_s_per_step": hooks,
        "dispatch_s_per_idle_callback_per_step": dispatch,
    }


if __name__ == "__main__":
    main()
