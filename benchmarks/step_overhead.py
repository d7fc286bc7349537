"""Per-step overhead at steps small enough that the framework, not the model, sets the pace: digits (8x8), DigitsCNN
width 32, batch 16, one torch thread, CPU. About 10 ms a step, the range of GPU steps, where a few ms of Python
per step show.

1. Side by side, in alternating fresh processes (plain, Lightning, train.py, plain, ...): a plain PyTorch loop, a
   bare Lightning script and `python train.py` as users run it (progress bar, TensorBoard, diagnostics,
   checkpoints, metrics), with the same data, network and optimizer. Each run times the 73 steps after the
   first 5 of one epoch (78 steps), logging steps included. Printed: median, min and spread of the runs'
   mean s/step, and each one's ratio to bare Lightning.
2. The parts, in one process: bare Lightning plus one part (a callback of train.py or of the default callbacks,
   the TensorBoard logger, or the template's LightningModule with its metrics and logging), each against bare
   Lightning alone, in alternating rounds. Printed: the extra ms per step of each part and its share of bare
   Lightning's step.

    python benchmarks/step_overhead.py [--repeats 5] [--rounds 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
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
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, RichProgressBar
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

from overhead import STEP_TIMES, StepTimer, compare, now, seconds_per_step
from scaleup.data import DigitsDataModule
from scaleup.engine.callbacks import (
    ConfigInCheckpoint,
    LRScaling,
    MetricsFile,
    PreemptionCheckpoint,
    PrivateMetricStates,
    TrainingDiagnostics,
)
from scaleup.engine.callbacks.hparams import PlanHParams
from scaleup.engine.callbacks.lr_scaling import LRSchedule
from scaleup.engine.callbacks.performance import PerformanceSettings
from scaleup.engine.callbacks.progress import ThrottledRichProgressBar
from scaleup.engine.checkpoint import BatchProgressRescale, EpochProgressRepair
from scaleup.engine.checks import MonitorCheck, TrainLoaderCheck
from scaleup.engine.seeding import PerRankSeed
from scaleup.models import DigitsCNN, ImageClassifier
from scaleup.models.optim import build_optimizer

ROOT = Path(__file__).resolve().parents[1]
BATCH, WARMUP, STEPS = 16, 5, 73  # 1,257 training digits: 78 steps of 16 in one epoch
SGD = {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4, "nesterov": True}
NET = {"_target_": "scaleup.models.DigitsCNN", "num_classes": 10, "in_channels": 1, "width": 32}
# Rich draws as it would in a terminal (the output goes to a pipe here), where it costs what users pay.
TERMINAL = {"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1", "COLUMNS": "120"}


def digits_loader() -> DataLoader:
    datamodule = DigitsDataModule(global_batch_size=BATCH)
    datamodule.setup()
    torch.manual_seed(0)
    return DataLoader(datamodule.splits["train"], batch_size=BATCH, shuffle=True, drop_last=True)


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
    loader, net = digits_loader(), DigitsCNN(num_classes=10)
    opt = build_optimizer(SGD, net)
    net.train()
    times = []
    for x, y in loader:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        opt.step()
        times.extend(now())
    print(STEP_TIMES, *times, flush=True)


def bare_trainer(callbacks: list[L.Callback], logger: Any = False, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=logger,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=any(isinstance(c, RichProgressBar) for c in callbacks),
        enable_model_summary=False,
        callbacks=callbacks,
        **kwargs,
    )


def run_lightning() -> None:
    bare_trainer([StepTimer()]).fit(Bare(), digits_loader())


def template_command(run_dir: str) -> list[str]:
    """train.py with its defaults: only the batch, one epoch on CPU, and the step timer added."""
    return [
        sys.executable,
        "train.py",
        f"data.global_batch_size={BATCH}",
        "trainer.max_epochs=1",
        "trainer.accelerator=cpu",
        "+callbacks.step_timer._target_=overhead.StepTimer",
        f"hydra.run.dir={run_dir}",
    ]


class StopTiming(Exception):
    """Raised after the timed steps of a part: no epoch end, validation or checkpoint is timed."""


class PartTimer(L.Callback):
    """Wall and CPU seconds per step over the steps after `WARMUP`, then stops the fit."""

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
    schedule = LRSchedule(peak=0.25, warmup_steps=78, total_steps=936)  # batch 16 of base 64, 1 epoch warmup

    def callback(make: Callable[[], L.Callback]):
        return lambda: (Bare(), [make()], False)

    def tensorboard() -> TensorBoardLogger:
        return TensorBoardLogger(tmp, name="tb", version="", default_hp_metric=False)

    table = {
        "bare Lightning": lambda: (Bare(), [], False),
        "LRScaling": callback(lambda: LRScaling(schedule)),
        "PerRankSeed": callback(lambda: PerRankSeed(42)),
        "PrivateMetricStates": callback(PrivateMetricStates),
        "MonitorCheck": callback(lambda: MonitorCheck("val/acc", "max")),
        "TrainLoaderCheck": callback(TrainLoaderCheck),
        "ConfigInCheckpoint": callback(lambda: ConfigInCheckpoint({}, {})),
        "PreemptionCheckpoint": callback(lambda: PreemptionCheckpoint(tmp / "ckpt")),
        "EpochProgressRepair": callback(EpochProgressRepair),
        "BatchProgressRescale": callback(BatchProgressRescale),
        "MetricsFile": callback(lambda: MetricsFile(tmp / "metrics.json")),
        "PlanHParams": callback(lambda: PlanHParams({}, tmp / "metrics.json")),
        "PerformanceSettings": callback(lambda: PerformanceSettings(tf32=True, channels_last=False)),
        "ModelCheckpoint (best)": callback(lambda: ModelCheckpoint(tmp / "ckpt", monitor="val/acc", mode="max")),
        "ModelCheckpoint (last)": callback(lambda: ModelCheckpoint(tmp / "ckpt", filename="last")),
        "TrainingDiagnostics": callback(TrainingDiagnostics),
        "RichProgressBar (Lightning's)": callback(RichProgressBar),
        "ThrottledRichProgressBar": callback(ThrottledRichProgressBar),
        "TensorBoard logger": lambda: (Bare(), [], tensorboard()),
        "LearningRateMonitor (+ TensorBoard)": lambda: (Bare(), [LearningRateMonitor("step")], tensorboard()),
        "ImageClassifier (metrics, logging)": lambda: (ImageClassifier(NET, SGD), [], False),
        "ImageClassifier + TensorBoard": lambda: (ImageClassifier(NET, SGD), [], tensorboard()),
    }
    return table


def time_part(make: Callable[[], tuple[L.LightningModule, list[L.Callback], Any]]) -> dict[str, float]:
    module, callbacks, logger = make()
    timer = PartTimer()
    trainer = bare_trainer([*callbacks, timer], logger=logger, log_every_n_steps=10)
    with contextlib.suppress(StopTiming):
        trainer.fit(module, digits_loader())
    return timer.per_step()


def run_parts(rounds: int) -> None:
    """All parts, `rounds` times in alternating order; prints one JSON line of their per-step seconds."""
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        table = parts(Path(tmp))
        time_part(table["bare Lightning"])  # imports and first-call costs, untimed
        for _ in range(rounds):
            for name, make in table.items():
                results.setdefault(name, []).append(time_part(make))
    print("PARTS", json.dumps(results), flush=True)


def part_costs(results: dict[str, list[dict[str, float]]], clock: str) -> dict[str, dict[str, float]]:
    """Each part's extra seconds per step over bare Lightning in the same round, median over rounds."""
    bare = [r[clock] for r in results["bare Lightning"]]
    costs = {}
    for name, runs in results.items():
        if name == "bare Lightning":
            continue
        extra = [r[clock] - b for r, b in zip(runs, bare, strict=True)]
        costs[name] = {"extra_s": statistics.median(extra), "min_s": min(extra), "max_s": max(extra)}
        costs[name]["share_of_bare"] = costs[name]["extra_s"] / statistics.median(bare)
    return costs


def print_parts(costs: dict[str, dict[str, float]], bare: float, clock: str) -> None:
    print(f"\nper-step cost of each part over bare Lightning ({bare * 1e3:.2f} ms/step), {clock} time")
    print(f"{'':38s} {'extra ms/step':>13s} {'range':>15s} {'of bare':>8s}")
    for name, row in costs.items():
        spread = f"{row['min_s'] * 1e3:+.2f}..{row['max_s'] * 1e3:+.2f}"
        print(f"{name:38s} {row['extra_s'] * 1e3:+13.3f} {spread:>15s} {row['share_of_bare']:+8.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="alternating runs of each variant")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds over the parts")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--variant", choices=["lightning", "plain", "parts"], help=argparse.SUPPRESS)  # internal
    args = parser.parse_args()
    if args.variant:
        torch.set_num_threads(1)
        if args.variant == "parts":
            run_parts(args.rounds)
        else:
            {"lightning": run_lightning, "plain": run_plain}[args.variant]()
        return

    env = {
        **os.environ,
        **TERMINAL,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")]),
    }
    itself = [sys.executable, str(Path(__file__).resolve()), "--variant"]
    load = [os.getloadavg()]
    results: dict[str, list[dict[str, float]]] = {"plain loop": [], "bare Lightning": [], "train.py": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            commands = {
                "plain loop": [*itself, "plain"],
                "bare Lightning": [*itself, "lightning"],
                "train.py": template_command(f"{tmp}/run{i}"),
            }
            for name, command in commands.items():
                results[name].append(seconds_per_step(command, env, WARMUP, STEPS))
                last = results[name][-1]
                print(f"  run {i + 1}/{args.repeats} {name:15s} {last['wall'] * 1e3:.2f} ms/step wall")
    load.append(os.getloadavg())
    out = subprocess.run(
        [*itself, "parts", "--rounds", str(args.rounds)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise SystemExit(f"parts failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    load.append(os.getloadavg())
    part_runs = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("PARTS"))[6:])

    print(
        f"\ndigits, DigitsCNN width 32, batch {BATCH}, CPU, 1 thread; {STEPS} steps after {WARMUP}, "
        f"{args.repeats} alternating runs; load average {load[0][0]:.2f} .. {load[-1][0]:.2f} (1 min)"
    )
    summary = {
        clock: compare({name: [r[clock] for r in runs] for name, runs in results.items()}, clock, "bare Lightning")
        for clock in ("wall", "cpu")
    }
    costs = {}
    for clock in ("wall", "cpu"):
        costs[clock] = part_costs(part_runs, clock)
        print_parts(costs[clock], statistics.median(r[clock] for r in part_runs["bare Lightning"]), clock)
    if args.json:
        report = {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "load_average_1_5_15min": {"start": load[0], "after_variants": load[1], "end": load[2]},
            "cpus": os.cpu_count(),
            "config": {"batch": BATCH, "warmup": WARMUP, "steps": STEPS, "threads": 1} | vars(args) | {"json": None},
            "results": summary,
            "parts": {"runs": part_runs, "cost_over_bare_lightning": costs},
        }
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
