"""Throughput and where the step time goes (compute, data wait, exposed all-reduce) against the number of processes.

Weak scaling, as `data.per_device_batch_size` runs it: every process keeps its batch, so N processes should do N
times the work per step in the same time. Each world size runs in its own processes (gloo on CPU, NCCL on GPUs,
one process per device) with the network and synthetic data of train.py. Per step, on every rank:

- data wait: fetching the next batch and copying it to the device;
- compute: forward, backward and optimizer step, timed on every other step, run under DDP's `no_sync()`
  (gradients stay local);
- all-reduce: the time a step with gradient sync takes over one without: the communication backward could not
  hide. Steps with and without sync alternate, so both see the same machine.

Prints a table, writes a JSON file and a PNG plot (throughput against the ideal line, and the step split).

    python benchmarks/scaling.py                       # CPU: 1 and 2 processes, one thread each
    python benchmarks/scaling.py --world-sizes 1 2 4 8 # GPUs: up to the GPUs on this node
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from myproject.data.synthetic import SyntheticImages
from myproject.models import resnet

RESULTS = Path(__file__).resolve().parent / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed_steps(ddp, batches, opt, device, steps: int) -> dict[str, dict[str, float]]:
    """Mean data wait and step time of `steps` steps with the gradient all-reduce and `steps` without it
    (DDP's `no_sync()`), alternating step by step so both see the same machine."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    sums = {kind: {"data_wait": 0.0, "step": 0.0} for kind in ("synced", "local")}
    for i in range(2 * steps):
        kind = "local" if i % 2 else "synced"
        start = time.perf_counter()
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        sync()
        fetched = time.perf_counter()
        with ddp.no_sync() if kind == "local" else nullcontext():
            F.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()  # a cheap point: the step is done on the device, so the host clock is the device's time
        sums[kind]["data_wait"] += fetched - start
        sums[kind]["step"] += time.perf_counter() - start
    return {kind: {key: value / steps for key, value in times.items()} for kind, times in sums.items()}


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    cuda = args.device == "cuda"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    net = resnet(args.net, num_classes=10, small_input=args.image_size <= 64).to(device)
    ddp = DistributedDataParallel(net, device_ids=[rank] if cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    steps = 2 * (args.warmup + args.steps)
    images = SyntheticImages(steps * args.batch * world, (3, args.image_size, args.image_size), 10, 0, 0, 1.0)
    loader = DataLoader(
        images,
        batch_size=args.batch,
        sampler=DistributedSampler(images, world, rank, shuffle=True, seed=0),
        num_workers=args.num_workers,
        pin_memory=cuda,
        drop_last=True,
        persistent_workers=args.num_workers > 0,
    )
    batches = iter(loader)
    timed_steps(ddp, batches, opt, device, args.warmup)
    times = timed_steps(ddp, batches, opt, device, args.steps)
    synced, local = times["synced"], times["local"]
    mine = {
        "step": synced["step"],
        "data_wait": synced["data_wait"],
        "compute": local["step"] - local["data_wait"],
        "all_reduce": max(0.0, synced["step"] - local["step"]),
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        row = {key: statistics.mean(r[key] for r in gathered) for key in mine}
        row["step"] = max(r["step"] for r in gathered)  # the slowest rank sets everyone's pace
        row["world_size"] = world
        row["samples_per_s"] = world * args.batch / row["step"]
        Path(out).write_text(json.dumps(row))
    dist.destroy_process_group()


def plot(rows: list[dict], title: str, path: Path) -> None:
    from matplotlib.figure import Figure

    worlds = [r["world_size"] for r in rows]
    figure = Figure(figsize=(10, 4.2), dpi=100)
    left, right = figure.subplots(1, 2)
    base = rows[0]["samples_per_s"] / rows[0]["world_size"]
    left.plot(worlds, [base * w for w in worlds], "--", color="gray", label="ideal (linear)")
    left.plot(worlds, [r["samples_per_s"] for r in rows], "o-", label="measured")
    for r in rows:
        where = (r["world_size"], r["samples_per_s"])
        left.annotate(f"{r['efficiency']:.0%}", where, textcoords="offset points", xytext=(6, -12))
    left.set(xlabel="processes (devices)", ylabel="samples / s (global)", title="throughput", xticks=worlds)
    left.margins(x=0.15)
    left.legend()
    bottom = [0.0] * len(rows)
    labels = [str(w) for w in worlds]
    for key, color in (("compute", "tab:blue"), ("data_wait", "tab:orange"), ("all_reduce", "tab:red")):
        values = [r[key] for r in rows]
        right.bar(labels, values, bottom=bottom, color=color, label=key.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    right.set(xlabel="processes (devices)", ylabel="seconds per step", title="where a step's time goes")
    right.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if cuda else "cpu")
    parser.add_argument("--net", default="resnet50" if cuda else "resnet18")
    parser.add_argument("--image-size", type=int, default=224 if cuda else 32)
    parser.add_argument("--batch", type=int, default=64 if cuda else 32, help="per process")
    parser.add_argument("--num-workers", type=int, default=6 if cuda else 0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (CPU: one core each)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per phase")
    parser.add_argument("--out", type=Path, default=RESULTS / f"scaling_{'gpu' if cuda else 'cpu'}")
    args = parser.parse_args()

    rows, load_before = [], os.getloadavg()  # other work on the machine skews the numbers: recorded with them
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.world_sizes:
            out = f"{tmp}/{world}.json"
            mp.spawn(worker, args=(world, free_port(), args, out), nprocs=world)
            rows.append(json.loads(Path(out).read_text()))
            r = rows[-1]
            r["efficiency"] = r["samples_per_s"] / (world * rows[0]["samples_per_s"] / rows[0]["world_size"])
            print(
                f"{world} process(es): {r['samples_per_s']:8.1f} samples/s ({r['efficiency']:.0%} of linear scaling), "
                f"step {r['step']:.3f} s = compute "
                f"{r['compute']:.3f} + data wait {r['data_wait']:.3f} + all-reduce {r['all_reduce']:.3f}",
                flush=True,
            )
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {args.threads} thread(s) per process"
    title = (
        f"{args.net}, {args.image_size} px, batch {args.batch} per process; {device}\n"
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, load average {load_before[0]:.1f} before the runs"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    load = {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()}
    report = {"title": title, "date": time.strftime("%Y-%m-%d"), "config": config, "load_average": load, "rows": rows}
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    plot(rows, title, args.out.with_suffix(".png"))
    print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
