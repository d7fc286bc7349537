"""`data.max_per_device_batch_size=auto` on a real GPU, and what SyncBatchNorm costs.

    python benchmarks/auto_batch.py               # writes benchmarks/results/auto_batch.json
    python benchmarks/auto_batch.py --cpu-smoke   # the same script on a tiny run on CPU (checks the script)

1. The probe against the truth. `train.py` with the Goyal et al. recipe (ResNet-50, 224 px synthetic images,
   bf16-mixed) at a global batch of 2048 on one GPU, `data.max_per_device_batch_size=auto`, a few steps: the
   per-device batch the probe settled on, the accumulation, the probe's time, and the peak memory of real
   training at that batch against the GPU's memory. Then the same run with the next larger exact split forced
   as a number cap: it should run out of memory or leave less than the probe's 10% margin.
2. SyncBatchNorm's cost, on all visible GPUs (needs 2 or more; one GPU has nothing to sync): the same ResNet-50
   run at 32 images per GPU with `trainer.sync_batchnorm=true` and `false`, global img/s (perf/samples_per_s)
   of each and their ratio. `auto` leaves SyncBN off at 32 per GPU; this is the price it avoids.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

from scaleup.plan.batch_probe import per_device_candidates

ROOT = Path(__file__).resolve().parents[1]


def train(overrides: list[str], run_dir: Path, timeout: float) -> dict:
    """One `python train.py` run; its exit code, wall time, plan, metrics and the probe's log line."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "train.py", *overrides, "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}"]
    start = time.perf_counter()
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    result = {"returncode": out.returncode, "wall_s": round(time.perf_counter() - start, 1)}
    for name in ("plan", "metrics"):
        path = run_dir / f"{name}.json"
        result[name] = json.loads(path.read_text()) if path.is_file() else None
    log = (out.stdout + out.stderr).splitlines()
    probe = [line.split(" - ", 1)[-1] for line in log if "max_per_device_batch_size=auto:" in line]
    result["probe"] = probe[0] if probe else None
    result["out_of_memory"] = any("out of memory" in line.lower() for line in log)
    if out.returncode:
        result["tail"] = log[-15:]
    return result


def recipe(args: argparse.Namespace) -> list[str]:
    if args.cpu_smoke:
        return [
            "data=synthetic",
            "data.global_batch_size=64",
            "data.image_shape=[3,16,16]",
            "data.num_workers=0",
            "model=resnet18",
            "model.net.small_input=true",
            "trainer.accelerator=cpu",
            f"trainer.max_steps={args.steps}",
            "trainer.num_sanity_val_steps=0",
            "trainer.limit_val_batches=1",
            "trainer.limit_test_batches=1",
        ]
    return [
        "experiment=goyal_imagenet",
        f"data.global_batch_size={args.global_batch}",
        f"data.train_size={args.global_batch * (args.steps + 2)}",
        "data.val_size=512",
        "data.test_size=512",
        f"trainer.max_steps={args.steps}",
        "trainer.num_sanity_val_steps=0",
        "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=2",
        "logger=none",
    ]


def probe_part(args: argparse.Namespace, tmp: Path) -> dict:
    auto = train([*recipe(args), "data.max_per_device_batch_size=auto"], tmp / "auto", args.part_timeout)
    report = {"auto": auto}
    if auto["returncode"] or not auto["plan"]:
        return report
    chosen = auto["plan"]["per_device_batch_size"]
    larger = [size for size in per_device_candidates(auto["plan"]["global_batch_size"], 1) if size > chosen]
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory / 1e9
        peak = (auto["metrics"] or {}).get("perf/peak_mem_gb")
        report["gpu_memory_gb"] = round(total, 1)
        report["peak_share_of_gpu"] = round(peak / total, 3) if peak else None
    if larger:  # the next larger exact split, forced: the probe said it does not fit
        cap = f"data.max_per_device_batch_size={larger[-1]}"
        forced = train([*recipe(args), cap], tmp / "larger", args.part_timeout)
        report["next_larger"] = {"per_device": larger[-1], **forced}
    return report


def syncbn_part(args: argparse.Namespace, tmp: Path) -> dict:
    gpus = torch.cuda.device_count()
    if gpus < 2 and not args.cpu_smoke:
        return {"skipped": f"{gpus} GPU visible: SyncBatchNorm syncs nothing on one device"}
    devices = 2 if args.cpu_smoke else gpus
    runs = {}
    for sync in ("false", "true"):
        if args.cpu_smoke and sync == "true":
            runs[sync] = {"skipped": "torch refuses SyncBatchNorm on CPU"}
            continue
        overrides = [*recipe(args), f"trainer.devices={devices}", f"trainer.sync_batchnorm={sync}"]
        if not args.cpu_smoke:
            overrides.append(f"data.global_batch_size={32 * devices}")
        runs[sync] = train(overrides, tmp / f"sync_{sync}", args.part_timeout)
    speed = {k: (r.get("metrics") or {}).get("perf/samples_per_s") for k, r in runs.items()}
    if speed.get("true") and speed.get("false"):
        runs["syncbn_slowdown"] = round(speed["false"] / speed["true"], 3)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--global-batch", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--part-timeout", type=float, default=240)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny run on CPU: checks the script, no numbers")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/auto_batch.json")
    args = parser.parse_args()
    if args.cpu_smoke:
        args.steps = 2
    with tempfile.TemporaryDirectory() as tmp:
        report = {
            "date": date.today().isoformat(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU)",
            "torch": torch.__version__,
            "probe": probe_part(args, Path(tmp)),
            "syncbn": syncbn_part(args, Path(tmp)),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    auto = report["probe"]["auto"]
    print(re.sub(r"\s+", " ", f"auto: {auto.get('probe')} (exit {auto['returncode']}, {auto['wall_s']} s)"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
