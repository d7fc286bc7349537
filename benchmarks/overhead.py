"""Steady-state seconds per training step, side by side: `train.py` as users run it (progress bar, TensorBoard,
diagnostics, checkpoints), a bare Lightning script and a plain PyTorch loop, on the same data, network and
optimizer: synthetic 32 px images, ResNet-18 with the 32 px stem, batch 64, SGD with Nesterov momentum, CPU.

Each run is a fresh process; runs alternate (train.py, Lightning, plain, train.py, ...) so that a machine getting
busier or quieter affects all three alike. A run times `--steps` steps after `--warmup` steps. Printed: the median,
min and spread (max - min over median) of each, and each one's speed relative to the plain loop, with a verdict
on whether the difference is larger than the run-to-run spread. Then the per-step cost of the diagnostics
callback's hooks, timed alone, as a share of the template's step.

    python benchmarks/overhead.py [--batch 64] [--repeats 3] [--warmup 5] [--steps 25] [--threads 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from myproject.data.synthetic import SyntheticImages
from myproject.models import resnet
from scaleup.callbacks.diagnostics import TrainingDiagnostics

ROOT = Path(__file__).resolve().parents[1]
LR, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 5e-4  # configs/model/optimizer/sgd.yaml
STEP_TIMES = "STEP_TIMES"


def now() -> tuple[float, float]:
    """Wall time, and the CPU time of all this process's threads: the work done, however busy the machine is."""
    return time.perf_counter(), time.process_time()


def print_step_times(times: list[float]) -> None:
    """The STEP_TIMES line in one write to the process's stdout, past a progress bar's redirection of sys.stdout (which
    would wrap the line). Printed in parts, the line of about 10 kB came back short beside Lightning's TQDM bar, which
    writes to the same file (a redraw from tqdm's monitor thread, likely, taken inside it)."""
    sys.__stdout__.flush()
    os.write(sys.__stdout__.fileno(), " ".join([STEP_TIMES, *map(str, times)]).encode() + b"\n")


class StepTimer(L.Callback):
    """Prints wall and CPU time at the end of every training step (for the variants run through Lightning)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.extend(now())

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            print_step_times(self.times)


def data_and_net(train_size: int, batch: int) -> tuple[DataLoader, torch.nn.Module]:
    """The data and network train.py builds for data=synthetic model=resnet18 model.net.small_input=true."""
    torch.manual_seed(0)
    images = SyntheticImages(train_size, (3, 32, 32), num_classes=10, seed=0, offset=0, noise=1.0)
    loader = DataLoader(images, batch_size=batch, shuffle=True, drop_last=True, num_workers=0)
    return loader, resnet("resnet18", num_classes=10, small_input=True)


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, nesterov=True)


class Bare(L.LightningModule):
    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return optimizer(self.parameters())


def run_lightning(steps: int, batch: int) -> None:
    loader, net = data_and_net(steps * batch, batch)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[StepTimer()],
    )
    trainer.fit(Bare(net), loader)


def plain_loop(loader: DataLoader, net: torch.nn.Module, opt: torch.optim.Optimizer, epochs: int = 1) -> None:
    """The plain PyTorch training loop every comparison starts from; prints each step's end time."""
    net.train()
    times = []
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(x), y).backward()
            opt.step()
            times.extend(now())
    print_step_times(times)


def run_plain(steps: int, batch: int) -> None:
    loader, net = data_and_net(steps * batch, batch)
    plain_loop(loader, net, optimizer(net.parameters()))


def template_command(steps: int, batch: int, run_dir: str) -> list[str]:
    return [
        sys.executable,
        "train.py",
        "data=synthetic",
        "model=resnet18",
        "model.net.small_input=true",
        "data.num_workers=0",  # the other two load in the training process too
        f"data.global_batch_size={batch}",
        f"data.train_size={steps * batch}",  # one epoch: no validation inside the timed steps
        f"data.val_size={batch}",
        f"data.test_size={batch}",
        f"trainer.max_steps={steps}",
        "trainer.accelerator=cpu",
        "+callbacks.step_timer._target_=overhead.StepTimer",
        f"hydra.run.dir={run_dir}",
    ]


def printed_numbers(command: list[str], env: dict[str, str], marker: str, timeout: float | None = None) -> list[float]:
    """Runs `command` in the project root and returns the numbers it printed after `marker` on one line."""
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return numbers_after(out.stdout, marker)


def numbers_after(output: str, marker: str) -> list[float]:
    """The numbers printed after `marker` on its line of `output` (a progress bar may precede it there)."""
    line = next(line for line in output.splitlines() if marker in line)
    return [float(n) for n in line[line.index(marker) :].split()[1:]]


def seconds_per_step(
    command: list[str],
    env: dict[str, str],
    warmup: int,
    steps: int,
    timeout: float | None = None,
    epochs: int = 1,
) -> dict[str, float]:
    """Wall and CPU seconds per step over the `steps` steps after `warmup`, in each of `epochs` epochs of
    `warmup + steps` steps: what happens between epochs (validation, checkpoints) is not counted."""
    pairs = printed_numbers(command, env, STEP_TIMES, timeout)
    wall, cpu = pairs[0::2], pairs[1::2]
    spans = [(e * (warmup + steps) + warmup - 1, (e + 1) * (warmup + steps) - 1) for e in range(epochs)]
    return {
        "wall": sum(wall[last] - wall[first] for first, last in spans) / (steps * epochs),
        "cpu": sum(cpu[last] - cpu[first] for first, last in spans) / (steps * epochs),
    }


def diagnostics_seconds_per_step(batch: int, repeats: int = 20_000) -> float:
    """The diagnostics hooks alone, per step (host time; on a GPU that is recording two CUDA events)."""
    module = L.LightningModule()
    if torch.cuda.is_available():
        module = module.cuda()
    diagnostics = TrainingDiagnostics()
    inputs = (torch.zeros(batch, 1, device=module.device), None)
    diagnostics.on_train_epoch_start(None, module)
    start = time.perf_counter()
    for i in range(repeats):
        diagnostics.on_train_batch_start(None, module, inputs, i)
        diagnostics.on_train_batch_end(None, module, None, inputs, i)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--variant", choices=["lightning", "plain"], help=argparse.SUPPRESS)  # one run, internal
    parser.add_argument("--total-steps", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        {"lightning": run_lightning, "plain": run_plain}[args.variant](args.total_steps, args.batch)
        return

    total = args.warmup + args.steps
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),  # the same torch thread count in every variant
        "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")]),
    }
    itself = [sys.executable, str(Path(__file__).resolve()), "--total-steps", str(total), "--batch", str(args.batch)]
    itself.append("--variant")
    results: dict[str, list[dict[str, float]]] = {"train.py": [], "bare Lightning": [], "plain loop": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            commands = {
                "train.py": template_command(total, args.batch, f"{tmp}/run{i}"),
                "bare Lightning": [*itself, "lightning"],
                "plain loop": [*itself, "plain"],
            }
            for name, command in commands.items():
                results[name].append(seconds_per_step(command, env, args.warmup, args.steps))
                last = results[name][-1]
                print(f"  run {i + 1}/{args.repeats} {name:15s} {last['wall']:.4f} s/step wall, {last['cpu']:.4f} CPU")

    print(
        f"\nResNet-18, 32 px, batch {args.batch}, CPU, {args.threads} thread(s); {args.steps} steps after "
        f"{args.warmup}, {args.repeats} alternating runs"
    )
    summary = {
        clock: compare({name: [r[clock] for r in runs] for name, runs in results.items()}, clock) for clock in CLOCKS
    }
    hooks = diagnostics_seconds_per_step(args.batch)
    share = hooks / summary["wall"]["train.py"]["median"]
    print(f"\ndiagnostics hooks: {hooks * 1e6:.1f} us per step = {share:.4%} of the template's step (wall)")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("variant", "total_steps")} | {"json": str(args.json)}
        report = {"date": time.strftime("%Y-%m-%d"), "load_average": os.getloadavg(), "cpus": os.cpu_count()}
        report |= {"config": config, "results": summary, "diagnostics_share": share}
        args.json.write_text(json.dumps(report, indent=2) + "\n")


CLOCKS = {
    "wall": "wall time (what a user waits; on a shared machine it includes waiting for a core)",
    "cpu": "CPU time of the process's threads (the work done; robust to other load, not to spin-waiting threads)",
}


def compare(times: dict[str, list[float]], clock: str, baseline: str = "plain loop") -> dict[str, dict]:
    """Median, min and spread per variant, its time per step relative to `baseline` (and speed, the inverse),
    and whether the difference from the baseline exceeds the run-to-run spread of either."""
    summary = {name: summarise(values) for name, values in times.items()}
    base = summary[baseline]
    print(f"\n{CLOCKS[clock]}")
    print(f"{'':15s} {'median s/step':>13s} {'min':>8s} {'spread':>7s} {'x ' + baseline:>16s}")
    for name, row in summary.items():
        row["time_ratio"] = row["median"] / base["median"]
        row["speed_vs_baseline"] = 1 / row["time_ratio"]
        print(f"{name:15s} {row['median']:13.4f} {row['min']:8.4f} {row['spread']:7.1%} {row['time_ratio']:16.3f}")
    for name in [name for name in summary if name != baseline]:
        difference = abs(1 - summary[name]["time_ratio"])
        noise = max(summary[name]["spread"], base["spread"])
        summary[name]["within_noise"] = difference <= noise
        verdict = "within" if difference <= noise else "larger than"
        print(f"{name} vs {baseline}: {difference:.1%} apart, {verdict} the run-to-run spread ({noise:.1%})")
    return summary


def summarise(times: list[float]) -> dict[str, float | list[float]]:
    median = statistics.median(times)
    return {"median": median, "min": min(times), "spread": (max(times) - min(times)) / median, "runs": times}


if __name__ == "__main__":
    main()
