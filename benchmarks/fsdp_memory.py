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

Results go to benchmarks/results/fsdp_memory_cpu.json. Takes about 3 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from scaleup.distributed.fsdp import model_state_bytes, shard

WIDTH, BLOCKS, SAMPLES, STEPS = 1024, 12, 512, 2
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

    torch.manual_seed(0)
    model = nn.ModuleDict({"net": nn.Sequential(*(Block(WIDTH) for _ in range(BLOCKS)))})
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


def mib(count: float) -> float:
    return round(count / 2**20, 1)


def main() -> int:
    # glibc keeps freed heap blocks (up to 32 MB each, once it has raised its mmap threshold) in the process, so the
    # RSS of FSDP's gather-and-free of every unit would count memory that is free. With a fixed threshold, blocks
    # from 128 KiB up are mapped and unmapped: the RSS follows the live memory. The workers inherit it.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    results = {}
    for index, (name, setup) in enumerate(SETUPS.items()):
        out = RESULTS.parent / f".{index}.json"
        mp.start_processes(worker, args=(setup, 29630 + index, str(out)), nprocs=2, start_method="spawn")
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
    RESULTS.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{'set-up':34} {'model state / rank (MiB)':>26} {'peak above start / rank (MiB)':>31}")
    for name, row in results.items():
        print(f"{name:34} {row['model_state_mib_per_rank']!s:>26} {row['peak_above_start_mib_per_rank']!s:>31}")
    print(
        f"FSDP / DDP: model state {ratio:.2f}x, peak {peak_ratio:.2f}x; activation checkpointing / FSDP peak "
        f"{summary['activation_checkpointing_over_fsdp_peak']:.2f}x ({results['ddp']['parameters_m']}M parameters)"
    )
    return 0 if ratio <= 0.6 else 1


if __name__ == "__main__":
    sys.exit(main())
