"""A model larger than a rank may hold, built on the meta device and sharded: `python tests/fsdp_meta.py [OUT_DIR]`.

Two gloo processes set up a 34M-parameter network (16 MLP blocks, 134 MB in float32) as strategy=fsdp does with
strategy.meta_init (fsdp.build_recorded, then fsdp.shard_built), each under a hard limit on its data memory
(RLIMIT_DATA) of 0.75x the network's parameters above what it held before. The same limit refuses the ordinary
build (checked in the same processes). Each rank's shards must equal its slice of the ordinary build's weights
(built after the limit is lifted), and one training step must run on the shards. Exit 1 if any is off.
"""

import json
import os
import resource
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from scaleup.distributed.fsdp import build_recorded, shard_built
from scaleup.distributed.meta_init import local_part

WIDTH, BLOCKS, LIMIT = 512, 16, 0.75


def build() -> nn.Module:
    torch.manual_seed(0)
    blocks = (nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)) for _ in range(BLOCKS))
    return nn.ModuleDict({"net": nn.Sequential(*blocks)})


def data_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData"))


def refused(build_eagerly) -> bool:
    try:
        build_eagerly()
    except (MemoryError, RuntimeError):  # torch's "DefaultCPUAllocator: can't allocate memory"
        return True
    return False


def worker(rank: int, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    with torch.device("meta"):
        full_bytes = sum(p.numel() * p.element_size() for p in build().parameters())
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = data_bytes() + int(LIMIT * full_bytes)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    model, recording = build_recorded(build)
    shard_built(model, mesh, None, recording, torch.device("cpu"), {})
    eager_refused = refused(build)
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    eager = dict(build().named_parameters())
    worst = max((p.to_local() - local_part(eager[name], p)).abs().max().item() for name, p in model.named_parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model["net"](torch.randn(4, WIDTH)).square().mean()
    loss.backward()
    optimizer.step()
    result = {"rank": rank, "limit_mib": LIMIT * full_bytes / 2**20, "parameters_mib": full_bytes / 2**20}
    result |= {"eager_refused": eager_refused, "worst": worst, "loss": loss.item(), "recorded": recording is not None}
    results: list = [None, None]
    dist.all_gather_object(results, result)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main() -> int:
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # Blocks from 128 KiB up mapped and unmapped, so that the data memory follows what is live (glibc would keep
        # freed blocks of the replay's full tensors in the heap). glibc reads it at start: start again with it.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
    out = os.path.join(sys.argv[1] if len(sys.argv) > 1 else ".", "meta.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(out, port), nprocs=2, start_method="fork")  # fork: no second import of torch
    with open(out) as f:
        results = json.load(f)
    print(json.dumps(results))
    ok = all(r["recorded"] and r["eager_refused"] and r["worst"] == 0 and r["loss"] == r["loss"] for r in results)
    return int(not ok)


if __name__ == "__main__":
    sys.exit(main())
