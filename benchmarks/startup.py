"""`python train.py` (default config) against a plain Lightning script on the same data, side by side.

Alternates the two, 3 runs each, and prints medians of wall time and of time to the first optimizer step.
Run from the repo root: python benchmarks/startup.py
"""

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'benchmarks'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def timed(cmd: list[str]) -> tuple[float, float]:
    start = time.time()
    out = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, check=True).stdout
    wall = time.time() - start
    first = next(float(line.split()[1]) for line in out.splitlines() if line.startswith("FIRST_STEP_AT"))
    return wall, first - start


def main(repeats: int = 3) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        jobs = {
            "scaleup train.py": lambda i: [
                sys.executable,
                "train.py",
                "trainer.enable_progress_bar=false",
                "+callbacks.timer._target_=first_step.FirstStepTimer",
                f"hydra.run.dir={tmp}/run{i}",
            ],
            "plain Lightning": lambda i: [sys.executable, "benchmarks/plain_lightning.py"],
        }
        results = {name: [] for name in jobs}
        for i in range(repeats):
            for name, cmd in jobs.items():
                results[name].append(timed(cmd(i)))
    medians = {name: [statistics.median(r[k] for r in runs) for k in (0, 1)] for name, runs in results.items()}
    base_wall, base_first = medians["plain Lightning"]
    for name, (wall, first) in medians.items():
        print(
            f"{name:18s} wall {wall:5.2f} s ({wall / base_wall:.2f}x)   first step {first:5.2f} s "
            f"({first / base_first:.2f}x)   walls: {[f'{r[0]:.2f}' for r in results[name]]}"
        )


if __name__ == "__main__":
    main()
