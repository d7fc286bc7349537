"""The training sampler at 10^6 to 10^12 samples, side by side with torch's DistributedSampler, in one run.

Both play rank 3 of 8 with a global batch of 1024 (128 indices per rank per step), over a `range(n)` dataset, so
only the sampler costs anything. Each (sampler, n) runs in a fresh process, which measures:
- epoch start: `set_epoch` + `iter(sampler)` + the first index;
- ns per index: the next 10^6 indices (fewer if the epoch holds fewer), drawn from the sampler;
- first batch: `set_epoch` on the next epoch, then the first 128-sample batch of a DataLoader over the sampler,
  as the training loop asks for it;
- peak RSS: the process's peak resident memory (getrusage) minus its peak after the imports and the dataset.
Each figure is the median of 3 processes (1 where a process takes over 10 s). The machine may be shared: the
figures of one run are comparable with each other, less so with another run's.
torch's sampler builds the epoch as a Python list of n ints (about 36 bytes each, plus its tensor): where that
cannot fit in this machine's memory it is not run, and the table says so.

    python benchmarks/sampler.py [--sizes 1e6 1e8 1e9 1e12] [--out benchmarks/results]

Writes sampler_cpu.json, sampler_cpu.md (the table) and sampler_cpu.png (the plot) under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORLD, RANK, GLOBAL_BATCH = 8, 3, 1024
PER_RANK = GLOBAL_BATCH // WORLD
STEADY_INDICES = 10**6
REPEATS, QUICK_S = 3, 10.0
TORCH_BYTES_PER_INDEX = 8 + 36  # randperm's int64 tensor, then .tolist(): an 8-byte pointer and a 28-byte int each
SAMPLERS = {"scaleup": "scaleup GlobalBatchSampler", "torch": "torch DistributedSampler"}
ROOT = Path(__file__).resolve().parents[1]


def sampler_class(name: str) -> type:
    """The sampler under test (imported before the memory baseline: its imports are not the sampler's cost)."""
    if name == "scaleup":
        from scaleup.data.samplers import GlobalBatchSampler

        return GlobalBatchSampler
    from torch.utils.data import DistributedSampler

    return DistributedSampler


def make_sampler(cls: type, n: int):
    """Rank 3 of 8 over range(n), shuffled with seed 0, the tail dropped."""
    if cls.__name__ == "GlobalBatchSampler":
        return cls(range(n), GLOBAL_BATCH, num_replicas=WORLD, rank=RANK, seed=0)
    return cls(range(n), num_replicas=WORLD, rank=RANK, shuffle=True, seed=0, drop_last=True)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def measure(name: str, n: int) -> dict[str, float]:
    """One (sampler, n) in this process: the figures the module docstring lists."""
    import itertools

    from torch.utils.data import DataLoader

    dataset, cls = range(n), sampler_class(name)
    baseline = peak_rss_mb()
    start = time.perf_counter()
    sampler = make_sampler(cls, n)
    sampler.set_epoch(1)
    indices = iter(sampler)
    next(indices)
    epoch_start = time.perf_counter() - start

    count = min(STEADY_INDICES, len(sampler) - 1)
    start = time.perf_counter()
    drawn = sum(1 for _ in itertools.islice(indices, count))
    ns_per_index = (time.perf_counter() - start) / drawn * 1e9
    del indices  # torch's epoch list: the next epoch's must not come on top of it

    start = time.perf_counter()
    sampler.set_epoch(2)
    first = next(iter(DataLoader(dataset, batch_size=PER_RANK, sampler=sampler)))
    first_batch = time.perf_counter() - start
    assert len(first) == PER_RANK
    return {
        "epoch_start_s": epoch_start,
        "first_batch_s": first_batch,
        "ns_per_index": ns_per_index,
        "peak_rss_extra_mb": peak_rss_mb() - baseline,
    }


def available_mb() -> float:
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    return int(fields["MemAvailable"].split()[0]) / 1024


def run_child(name: str, n: int) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, __file__, "--child", name, str(n)], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def median_run(name: str, n: int) -> dict[str, float]:
    """The median of each figure over 3 fresh processes, or 1 where a process takes more than QUICK_S."""
    start = time.perf_counter()
    runs = [run_child(name, n)]
    if time.perf_counter() - start < QUICK_S:
        runs += [run_child(name, n) for _ in range(REPEATS - 1)]
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]} | {"runs": len(runs)}


def table(rows: list[dict]) -> str:
    lines = [
        "| sampler | samples | epoch start (s) | first batch (s) | ns per index | peak RSS extra (MB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        head = f"| {SAMPLERS[row['sampler']]} | {row['n']:.0e} |"
        if "skipped" in row:
            lines.append(f"{head} not run: {row['skipped']} | | | |")
        else:
            lines.append(
                f"{head} {row['epoch_start_s']:.4f} | {row['first_batch_s']:.4f} | {row['ns_per_index']:.0f} "
                f"| {row['peak_rss_extra_mb']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, label in SAMPLERS.items():
        ran = [r for r in rows if r["sampler"] == name and "skipped" not in r]
        sizes = [r["n"] for r in ran]
        left.plot(sizes, [r["first_batch_s"] for r in ran], "o-", label=label)
        right.plot(sizes, [max(r["peak_rss_extra_mb"], 0.1) for r in ran], "o-", label=label)
    left.set(xscale="log", yscale="log", xlabel="samples", ylabel="s", title="time to the first batch (rank 3 of 8)")
    right.set(xscale="log", yscale="log", xlabel="samples", ylabel="MB", title="peak RSS above baseline, per rank")
    for axis in (left, right):
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1e6, 1e8, 1e9, 1e12])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--child", nargs=2, metavar=("SAMPLER", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]))))
        return
    rows = []
    for n in map(int, args.sizes):
        for name in SAMPLERS:
            needed_mb = n * TORCH_BYTES_PER_INDEX / 2**20
            if name == "torch" and needed_mb > 0.8 * available_mb():
                row = {"skipped": f"its epoch list needs ~{needed_mb / 1024:,.0f} GB, {available_mb() / 1024:.0f} free"}
            else:
                row = median_run(name, n)
            rows.append({"sampler": name, "n": n, **row})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    import numpy
    import torch

    machine = {
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "world": WORLD,
        "rank": RANK,
        "global_batch": GLOBAL_BATCH,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sampler_cpu.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")
    (args.out / "sampler_cpu.md").write_text(table(rows))
    plot(rows, args.out / "sampler_cpu.png")
    print(f"\n{table(rows)}\nwritten to {args.out}/sampler_cpu.{{json,md,png}}")


if __name__ == "__main__":
    main()
