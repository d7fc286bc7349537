"""The speedup estimate (`python train.py dry_run=true trainer.devices=M diagnostics_from=<run>`) against real runs.

Runs `python train.py` on 1, 2 and 3 CPU processes (gloo, one torch thread each) with the same global batch (48:
48, 24 and 16 per process), one short epoch each, then estimates every run's time per optimizer step from each of
the other runs with scaleup.observability.speedup (the model the dry run prints) and prints the ratio of estimate to
measurement, and how many estimates fall within 15% of it. On a machine with fewer cores than processes the
processes share cores, which the model (compute per sample as measured) does not know: the ratios say how far that
carries.

    python benchmarks/speedup_estimate.py [--world-sizes 1 2 3] [--batches 30] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scaleup.observability.speedup import estimate, measured_run, target_of

ROOT = Path(__file__).resolve().parents[1]
GLOBAL_BATCH = 48  # divides into 1, 2 and 3 processes
TOLERANCE = 0.15  # how far an estimate may be from the measured step (a ratio within 1 +- this)


def train(run_dir: Path, world_size: int, batches: int) -> None:
    """One short training run of the example project on `world_size` CPU processes."""
    command = [
        sys.executable,
        "train.py",
        f"trainer.devices={world_size}",
        "trainer.accelerator=cpu",
        f"data.global_batch_size={GLOBAL_BATCH}",
        "trainer.max_epochs=1",
        f"trainer.limit_train_batches={batches}",
        "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1",
        "trainer.num_sanity_val_steps=0",
        "trainer.enable_progress_bar=false",
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{out.stderr[-4000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--batches", type=int, default=30, help="training batches per run")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for world in args.world_sizes:
            started = time.perf_counter()
            train(Path(tmp) / str(world), world, args.batches)
            runs[world] = Path(tmp) / str(world)
            m = measured_run(str(runs[world]))
            comm = "-" if m.comm is None else f"{1000 * m.comm:.2f}"
            print(
                f"{world} process(es): {1000 * m.step:.1f} ms per optimizer step measured (median compute "
                f"{1000 * m.compute:.1f} ms, data wait {1000 * m.data_wait:.2f} ms, exposed all-reduce {comm} ms per "
                f"step); run took {time.perf_counter() - started:.0f} s",
                flush=True,
            )
        measured = {world: measured_run(str(directory)) for world, directory in runs.items()}
        targets = {
            world: target_of(json.loads((directory / "plan.json").read_text())) for world, directory in runs.items()
        }
    rows = []
    print("\nestimate / measured time per optimizer step (rows: the run estimated from; columns: the run estimated)")
    print("from \\ to " + "".join(f"{world:>10d}" for world in measured))
    for source, m in measured.items():
        cells = []
        for world, target in targets.items():
            result = estimate(m, target)
            ratio = result.step / measured[world].step
            rows.append({"from": source, "to": world, "estimate_s": result.step, "measured_s": measured[world].step,
                         "ratio": ratio, "comm_known": result.comm is not None})  # fmt: skip
            cells.append(f"{ratio:9.2f}{'' if result.comm is not None else '*'}")
        print(f"{source:>9d} " + "".join(cells))
    print("* communication unknown from a 1-process run: left out of the estimate (a lower bound)")
    others = [row for row in rows if row["from"] != row["to"]]
    beyond = [row for row in others if abs(row["ratio"] - 1) > TOLERANCE]
    print(
        f"within {TOLERANCE:.0%} of the measured step: {len(others) - len(beyond)} of {len(others)} estimates from "
        "another run" + "".join(f"; {r['from']} -> {r['to']}: {r['ratio']:.2f}" for r in beyond)
    )
    load = {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()}
    print(f"load average (1, 5, 15 min) before {load['before']}, after {load['after']}; {load['cpus']} CPUs")
    if args.json:
        report = {"date": time.strftime("%Y-%m-%d %H:%M"), "config": vars(args) | {"json": str(args.json)}}
        report |= {"global_batch": GLOBAL_BATCH, "load_average": load, "rows": rows, "tolerance": TOLERANCE}
        report["measured"] = {world: vars(m) for world, m in measured.items()}
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
