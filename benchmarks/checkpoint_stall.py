"""Training time lost per sharded checkpoint, written at once against in the background (`checkpoint.async_save`),
side by side: `python benchmarks/checkpoint_stall.py`.

The 100M-parameter network of benchmarks/fsdp_memory.py (12 residual MLP blocks, width 1024) in float32 with AdamW,
sharded as strategy=fsdp shards it, on 2 CPU processes (gloo): a checkpoint holds the weights and AdamW's two
moments, about 1.1 GiB, each rank writing its half. Three modes, in the same pair of processes, alternated over
rounds: `none` trains STEPS steps; `sync` and `async` train the same steps and save once, after the first, as
FSDPStrategy.save_checkpoint does (the sharded state dicts Lightning collects, then checkpoints/sharded.save_sharded
around torch.distributed.checkpoint.save, or checkpoints/background.BackgroundSaver), the async save waited for at
the end. Training time lost per save = the mode's wall time - `none`'s in the same round: for async it includes the
copy, what the writing thread takes from training's CPU, and any wait at the end for a write the steps after it did
not cover. Also reported: the time the training loop spent inside the save call.

Results go to benchmarks/results/checkpoint_stall_cpu.json. Takes about 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from fsdp_memory import BLOCKS, WIDTH, Block
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from scaleup.checkpoints.background import BackgroundSaver, split
from scaleup.checkpoints.sharded import save_sharded
from scaleup.distributed.fsdp import shard

SAMPLES, STEPS = 32, 3  # per rank; one save per mode and round, after the first step
MODES = ("none", "sync", "async")
RESULTS = Path(__file__).parent / "results" / "checkpoint_stall_cpu.json"


def lightning_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
    """What Lightning hands FSDPStrategy.save_checkpoint: the sharded state dicts (as ModelParallelStrategy collects
    them) and the loops' and callbacks' state (here a stand-in)."""
    options = StateDictOptions(cpu_offload=True)
    return {
        "state_dict": get_model_state_dict(model, options=options),
        "optimizer_states": [get_optimizer_state_dict(model, optimizer, options=options)],
        "global_step": step,
        "loops": {"fit_loop": {"step": step}},
    }


def save_now(checkpoint: dict, path: Path) -> None:
    """FSDPStrategy.save_checkpoint with async_save=False: every rank writes, then rank 0 puts it in place."""
    shards, meta = split(checkpoint)

    def write(tmp: Path) -> None:
        dcp.save(shards, checkpoint_id=tmp)
        if dist.get_rank() == 0:
            torch.save(meta, tmp / "meta.pt")

    save_sharded(path, write, is_global_zero=dist.get_rank() == 0, barrier=dist.barrier)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    mode: str,
    path: Path,
    saver: BackgroundSaver,
    steps: int = STEPS,
) -> tuple[float, float]:
    """`steps` steps, and but for `none` a save after the first: (wall seconds, seconds training waited in the save
    call), the same on both ranks. The steps after the save are the time an async write has to finish in."""
    dist.barrier()
    start, waited = time.perf_counter(), 0.0
    for step in range(1, steps + 1):
        optimizer.zero_grad(set_to_none=True)
        model["net"](x).square().mean().backward()
        optimizer.step()
        if mode != "none" and step == 1:
            saving = time.perf_counter()
            checkpoint = lightning_checkpoint(model, optimizer, step)
            if mode == "sync":
                save_now(checkpoint, path)
            else:
                saver.save(*split(checkpoint), path, is_global_zero=dist.get_rank() == 0)
            waited = time.perf_counter() - saving
    if mode == "async":
        saver.wait()
    dist.barrier()
    return time.perf_counter() - start, waited


def worker(rank: int, port: int, rounds: int, directory: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = nn.ModuleDict({"net": nn.Sequential(*(Block(WIDTH) for _ in range(BLOCKS)))})
    shard(model, init_device_mesh("cpu", (2,)), None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(SAMPLES, WIDTH, generator=torch.Generator().manual_seed(rank))
    saver, path = BackgroundSaver(), Path(directory) / "last.ckpt"
    for mode in ("sync", "async"):  # warm-up: AdamW's state, the checkpoint group, the files exist
        train(model, optimizer, x, mode, path, saver, steps=1)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    waited: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_ in range(rounds):
        for mode in MODES if round_ % 2 == 0 else MODES[::-1]:  # alternate the order: drift hits all modes alike
            wall, blocked = train(model, optimizer, x, mode, path, saver)
            times[mode].append(wall)
            waited[mode].append(blocked)
    if rank == 0:
        shard_bytes = sum(f.stat().st_size for f in path.iterdir())
        Path(out).write_text(json.dumps({"times": times, "waited": waited, "checkpoint_bytes": shard_bytes}))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=str(RESULTS.parent), help="where the checkpoints are written (a real disk)")
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix=".checkpoint_stall_", dir=args.dir)
    out = Path(directory) / "times.json"
    try:
        mp.start_processes(worker, args=(29640, args.rounds, directory, str(out)), nprocs=2, start_method="spawn")
        measured = json.loads(out.read_text())
    finally:
        shutil.rmtree(directory)
    times = measured["times"]
    lost = {mode: [t - none for t, none in zip(times[mode], times["none"], strict=True)] for mode in ("sync", "async")}
    sync, asynchronous = statistics.median(lost["sync"]), statistics.median(lost["async"])
    summary = {
        "seconds_lost_per_save": {mode: round(statistics.median(values), 3) for mode, values in lost.items()},
        "seconds_lost_per_save_by_round": {mode: [round(v, 3) for v in values] for mode, values in lost.items()},
        "async_over_sync": round(asynchronous / sync, 3),
        "seconds_waited_in_the_save_call": {
            mode: round(statistics.median(measured["waited"][mode]), 3) for mode in ("sync", "async")
        },
        "wall_seconds_by_round": {mode: [round(t, 2) for t in values] for mode, values in times.items()},
        "step_seconds": round(statistics.median(times["none"]) / STEPS, 3),
        "checkpoint_mib": round(measured["checkpoint_bytes"] / 2**20, 1),
        "steps_per_round": STEPS,
        "samples_per_rank": SAMPLES,
        "world_size": 2,
        "rounds": args.rounds,
        "dtype": "float32",
    }
    RESULTS.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(
        f"training time lost per save: sync {sync:.2f} s, async {asynchronous:.2f} s: {asynchronous / sync:.2f}x "
        f"(median of {args.rounds} rounds; {summary['checkpoint_mib']} MiB per checkpoint, then {STEPS - 1} steps of "
        f"{summary['step_seconds']:.2f} s)"
    )
    return 0 if asynchronous <= 0.2 * sync else 1


if __name__ == "__main__":
    sys.exit(main())
