"""Gradient clipping on FSDP2 shards equals clipping the whole model: `python tests/fsdp_clip.py`.

Two gloo processes shard the template's DigitsCNN (float64) as strategy=fsdp does, each takes half of one batch
through forward and backward, and clips with Lightning's own call (`Precision.clip_grad_by_norm`, what
`trainer.gradient_clip_val` runs). One process does the same on the whole batch, unsharded. The norm over all
shards and every clipped gradient must agree to 1e-12; prints the largest difference. Exit 1 if not.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import Precision

from scaleup.engine.fsdp import shard
from scaleup.models import DigitsCNN

CLIP = 0.05  # well below the gradient norm (~1): clipping binds


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"net": DigitsCNN(norm="group", width=8)}).double()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(16, 1, 8, 8, generator=generator, dtype=torch.float64), torch.randint(0, 10, (16,))


def clipped(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The gradient norm before clipping; clips the gradients of the parameters as the optimizer holds them (built
    after sharding, as Lightning builds it)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    F.cross_entropy(model["net"](x), y).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    Precision().clip_grad_by_norm(optimizer, CLIP)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def worker(rank: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("CLIP_PORT", "29611"))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh

    model = build()
    shard(model, init_device_mesh("cpu", (2,)), None)
    x, y = batch()
    norm = clipped(model, x[rank * 8 : (rank + 1) * 8], y[rank * 8 : (rank + 1) * 8])
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    if rank == 0:
        torch.save({"norm": norm, "grads": grads}, out)
    dist.destroy_process_group()


def main() -> int:
    out = os.path.join(sys.argv[1] if len(sys.argv) > 1 else ".", "sharded.pt")
    mp.start_processes(worker, args=(out,), nprocs=2, start_method="fork")  # fork: no second import of torch
    sharded = torch.load(out, weights_only=True)
    model = build()
    norm = clipped(model, *batch())
    worst = max((sharded["grads"][name] - p.grad).abs().max().item() for name, p in model.named_parameters())
    print(
        f"norm over all shards {sharded['norm']:.12g}, whole model {norm:.12g}; clipped gradients differ by {worst:.1e}"
    )
    return int(not (norm > CLIP and abs(sharded["norm"] - norm) < 1e-12 and worst < 1e-12))


if __name__ == "__main__":
    sys.exit(main())
