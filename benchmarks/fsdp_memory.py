"""Memory per rank, DDP vs strategy=fsdp, side by side: `python benchmarks/fsdp_memory.py`.

A ~100M-parameter MLP-block network (12 residual blocks of LayerNorm, Linear(1024, 4096), GELU, Linear(4096, 1024))
in float32, AdamW, on 2 CPU processes (gloo), 2 training steps of 512 samples per rank, in four set-ups, each in its
own pair of processes: DDP (torch's DistributedDataParallel, what strategy=ddp runs), FSDP as strategy=fsdp shards it
(distributed/fsdp.shard: every block, then the network), and both with activation checkpointing. Per rank it reports

- the model state it holds, measured on its tensors (distributed/fsdp.model_state_bytes: parameters, gradients, AdamW's
  two moments; a DTensor counts its local shard), after the first step;
- the peak resident memory during the two steps above what the process held before them (RSS sampled every 2 ms:
  CPUs have no allocator statistics; large blocks mapped and unmapped, so freed memory leaves the RSS), which adds
  activations and communication buffers.

Two more parts, each set-up in its own processes:
- `setup`: the peak resident memory per rank while the model is built and sharded (above what the process held
  before), built eagerly (every rank builds the whole model, then shards it) against strategy.meta_init (built on the
  meta device, each rank replaying its shards: fsdp.shard_built), on 2 and on 4 processes.
- `sync`: accumulation of 4 micro-batches of 32 samples, gradients reduce-scattered at every micro-batch against
  once per optimizer step (strategy.sync_gradients=step: fsdp.gradient_sync_paused), on 2 processes: seconds and
  reduce-scatters (torch's CommDebugMode) per optimizer step, and the peak above start.

Results go to benchmarks/results/fsdp_memory_cpu.json (`--part training|setup|sync`, repeatable, runs only those
and keeps the others' results). Takes about 6 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from scaleup.distributed.fsdp import (
    build_recorded,
    gradient_sync_paused,
    local_bytes,
    model_state_bytes,
    shard,
    shard_built,
)

WIDTH, BLOCKS, SAMPLES, STEPS = 1024, 12, 512, 2
MICRO_BATCHES, MICRO_SAMPLES, SYNC_STEPS = 4, 32, 3  # the sync part: 3 optimizer steps, the first not timed
RESULTS = Path(__file__).parent / "results" / "fsdp_memory_cpu.json"
SETUPS = {
    "ddp": {"fsdp": False, "activation_checkpointing": False},
    "fsdp": {"fsdp": True, "activation_checkpointing": False},
    "ddp + activation checkpointing": {"fsdp": False, "activation_checkpointing": True},
    "fsdp + activation checkpointing": {"fsdp": True, "activation_checkpointing": True},
}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """The largest resident set size seen while the context runs (a sampling thread)."""

    def __enter__(self) -> PeakRSS:
        self.peak, self._running = rss(), True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while self._running:
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        self._running = False
        self._thread.join()


def worker(rank: int, setup: dict[str, bool], port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed._composable import checkpoint
    from torch.distributed.device_mesh import init_device_mesh

    model = build()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if setup["fsdp"]:
        shard(model, init_device_mesh("cpu", (2,)), None, activation_checkpointing=setup["activation_checkpointing"])
        net = model["net"]
    else:
        if setup["activation_checkpointing"]:
            for block in model["net"]:
                checkpoint(block)
        net = nn.parallel.DistributedDataParallel(model["net"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(SAMPLES, WIDTH, generator=torch.Generator().manual_seed(rank))
    state: dict[str, int] = {}
    before = rss()
    with PeakRSS() as peak:
        for step in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            net(x).square().mean().backward()
            optimizer.step()
            if step == 0:
                state = model_state_bytes(model, optimizer)
    result = {"model_state": state, "peak_above_start": peak.peak - before, "total_parameter_bytes": total}
    ranks: list[dict] = [{}, {}]
    dist.all_gather_object(ranks, result)
    if rank == 0:
        Path(out).write_text(json.dumps(ranks))
    dist.destroy_process_group()


def build() -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict({"net": nn.Sequential(*(Block(WIDTH) for _ in range(BLOCKS)))})


def start(world_size: int, rank: int, port: int) -> object:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size,))


def finish(result: dict, rank: int, world_size: int, out: str) -> None:
    ranks: list[dict] = [{}] * world_size
    dist.all_gather_object(ranks, result)
    if rank == 0:
        Path(out).write_text(json.dumps(ranks))
    dist.destroy_process_group()


def setup_worker(rank: int, world_size: int, meta: bool, port: int, out: str) -> None:
    """Build and shard the model, eagerly or on the meta device: the peak above start, and the shards kept."""
    mesh = start(world_size, rank, port)
    before = rss()
    with PeakRSS() as peak:
        model, recording = build_recorded(build) if meta else (build(), None)
        shard_built(model, mesh, None, recording, torch.device("cpu"), {})
    finish({"peak_above_start": peak.peak - before, "shards": local_bytes(model.parameters())}, rank, world_size, out)


def sync_worker(rank: int, once: bool, port: int, out: str) -> None:
    """Accumulate 4 micro-batches per step, reducing gradients at each or once per step."""
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = start(2, rank, port)
    model = build()
    shard(model, mesh, None)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(MICRO_SAMPLES, WIDTH, generator=torch.Generator().manual_seed(rank))
    seconds, before = [], rss()
    with PeakRSS() as peak, CommDebugMode() as comm:
        for _ in range(SYNC_STEPS):
            dist.barrier()
            start_time = time.perf_counter()
            for micro_batch in range(MICRO_BATCHES):
                paused = once and micro_batch < MICRO_BATCHES - 1
                with gradient_sync_paused([model["net"]], whole=True) if paused else contextlib.nullcontext():
                    model["net"](x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seconds.append(time.perf_counter() - start_time)
    counts = {str(op): n for op, n in comm.get_comm_counts().items()}
    reduce_scatters = sum(n for op, n in counts.items() if "reduce_scatter" in op) / SYNC_STEPS
    result = {"s_per_step": seconds[1:], "reduce_scatters_per_step": reduce_scatters, "peak": peak.peak - before}
    finish(result, rank, 2, out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker: object, world_size: int, args: tuple, name: str) -> list[dict]:
    out = RESULTS.parent / f".{name}.json"
    mp.start_processes(worker, args=(*args, str(out)), nprocs=world_size, start_method="spawn")
    ranks = json.loads(out.read_text())
    out.unlink()
    return ranks


def setup_part() -> dict:
    rows = {}
    for world_size, meta in [(n, meta) for n in (2, 4) for meta in (False, True)]:
        ranks = spawn(setup_worker, world_size, (world_size, meta, free_port()), f"setup{world_size}{meta}")
        rows[f"{'meta' if meta else 'eager'}, {world_size} processes"] = {
            "peak_above_start_mib_per_rank": [mib(r["peak_above_start"]) for r in ranks],
            "shards_mib_per_rank": [mib(r["shards"]) for r in ranks],
        }
    ratios = {
        n: max(rows[f"meta, {n} processes"]["peak_above_start_mib_per_rank"])
        / max(rows[f"eager, {n} processes"]["peak_above_start_mib_per_rank"])
        for n in (2, 4)
    }
    print(f"{'set-up':22} {'peak above start / rank (MiB)':>40} {'shards / rank (MiB)':>30}")
    for name, row in rows.items():
        print(f"{name:22} {row['peak_above_start_mib_per_rank']!s:>40} {row['shards_mib_per_rank']!s:>30}")
    print(f"meta / eager set-up peak: {ratios[2]:.2f}x on 2 processes, {ratios[4]:.2f}x on 4")
    return {"rows": rows, "meta_over_eager_peak": {str(n): round(r, 3) for n, r in ratios.items()}}


def sync_part() -> dict:
    rows = {}
    for once in (False, True):
        ranks = spawn(sync_worker, 2, (once, free_port()), f"sync{once}")
        rows["once per step" if once else "every micro-batch"] = {
            "s_per_step": round(max(sum(r["s_per_step"]) / len(r["s_per_step"]) for r in ranks), 3),
            "reduce_scatters_per_step": ranks[0]["reduce_scatters_per_step"],
            "peak_above_start_mib_per_rank": [mib(r["peak"]) for r in ranks],
        }
    every, once = rows["every micro-batch"], rows["once per step"]
    print(f"{'gradients reduced':20} {'s / step':>10} {'reduce-scatters / step':>24} {'peak / rank (MiB)':>22}")
    for name, row in rows.items():
        print(
            f"{name:20} {row['s_per_step']:>10} {row['reduce_scatters_per_step']:>24} "
            f"{row['peak_above_start_mib_per_rank']!s:>22}"
        )
    ratio = once["s_per_step"] / every["s_per_step"]
    print(f"once / every micro-batch: {ratio:.2f}x the time per step ({MICRO_BATCHES} micro-batches)")
    return {"rows": rows, "once_over_every_s_per_step": round(ratio, 3), "micro_batches": MICRO_BATCHES}


def mib(count: float) -> float:
    return round(count / 2**20, 1)


def training_part() -> dict:
    # glibc keeps freed heap blocks (up to 32 MB each, once it has raised its mmap threshold) in the process, so the
    # RSS of FSDP's gather-and-free of every unit would count memory that is free. With a fixed threshold, blocks
    # from 128 KiB up are mapped and unmapped: the RSS follows the live memory. The workers inherit it.
    results = {}
    for index, (name, setup) in enumerate(SETUPS.items()):
        out = RESULTS.parent / f".{index}.json"
        mp.start_processes(worker, args=(setup, free_port(), str(out)), nprocs=2, start_method="spawn")
        ranks = json.loads(out.read_text())
        out.unlink()
        results[name] = {
            "model_state_mib_per_rank": [mib(sum(r["model_state"].values())) for r in ranks],
            "parts_mib_rank0": {k: mib(v) for k, v in ranks[0]["model_state"].items()},
            "peak_above_start_mib_per_rank": [mib(r["peak_above_start"]) for r in ranks],
            "parameters_m": round(ranks[0]["total_parameter_bytes"] / 4 / 1e6, 1),
        }
    ddp, fsdp = results["ddp"], results["fsdp"]
    ratio = max(fsdp["model_state_mib_per_rank"]) / max(ddp["model_state_mib_per_rank"])
    peak_ratio = max(fsdp["peak_above_start_mib_per_rank"]) / max(ddp["peak_above_start_mib_per_rank"])
    ac = results["fsdp + activation checkpointing"]["peak_above_start_mib_per_rank"]
    summary = {
        "setups": results,
        "fsdp_over_ddp_model_state": round(ratio, 3),
        "fsdp_over_ddp_peak": round(peak_ratio, 3),
        "activation_checkpointing_over_fsdp_peak": round(max(ac) / max(fsdp["peak_above_start_mib_per_rank"]), 3),
        "world_size": 2,
        "samples_per_rank": SAMPLES,
        "dtype": "float32",
    }
    print(f"{'set-up':34} {'model state / rank (MiB)':>26} {'peak above start / rank (MiB)':>31}")
    for name, row in results.items():
        print(f"{name:34} {row['model_state_mib_per_rank']!s:>26} {row['peak_above_start_mib_per_rank']!s:>31}")
    print(
        f"FSDP / DDP: model state {ratio:.2f}x, peak {peak_ratio:.2f}x; activation checkpointing / FSDP peak "
        f"{summary['activation_checkpointing_over_fsdp_peak']:.2f}x ({results['ddp']['parameters_m']}M parameters)"
    )
    return summary


PARTS = {"training": training_part, "setup": setup_part, "sync": sync_part}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", action="append", choices=PARTS, help="run only this part (repeatable)")
    chosen = parser.parse_args().part or list(PARTS)
    # glibc keeps freed heap blocks (up to 32 MB each, once it has raised its mmap threshold) in the process, so the
    # RSS of FSDP's gather-and-free of every unit would count memory that is free. With a fixed threshold, blocks
    # from 128 KiB up are mapped and unmapped: the RSS follows the live memory. The workers inherit it.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for name in chosen:
        results[name] = PARTS[name]()
        RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    training, setup = results.get("training", {}), results.get("setup", {})
    state_ok = training.get("fsdp_over_ddp_model_state", 0) <= 0.6
    setup_ok = setup.get("meta_over_eager_peak", {}).get("2", 0) <= 0.6
    return 0 if state_ok and setup_ok else 1


if __name__ == "__main__":
    sys.exit(main())
