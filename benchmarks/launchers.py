"""Wall time of the same CPU training run (digits, global batch 64, 4 epochs) on 1 process and on 2 processes
under each launcher, side by side. Run from the repo root: python benchmarks/launchers.py [repeats]"""

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["trainer.max_epochs=4", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
LAUNCHERS = {
    "1 process": [sys.executable, "train.py", "trainer.devices=1"],
    "2 x Lightning ddp": [sys.executable, "train.py", "trainer.devices=2"],
    "2 x torchrun": [*TORCHRUN, "trainer.devices=2"],
    "2 x ddp_spawn": [sys.executable, "train.py", "trainer.devices=2", "strategy.name=ddp_spawn"],
}


def main(repeats: int = 2) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    walls = {name: [] for name in LAUNCHERS}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            for name, cmd in LAUNCHERS.items():
                start = time.time()
                subprocess.run(
                    [*cmd, *COMMON, f"paths.log_dir={tmp}/{i}{len(walls[name])}{name[0]}"],
                    cwd=ROOT,
                    env=env,
                    capture_output=True,
                    check=True,
                )
                walls[name].append(time.time() - start)
    base = statistics.median(walls["1 process"])
    for name, runs in walls.items():
        wall = statistics.median(runs)
        print(f"{name:18s} {wall:5.2f} s ({wall / base:.2f}x of 1 process)   runs: {[f'{w:.2f}' for w in runs]}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
