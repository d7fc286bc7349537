"""Gradient clipping on FSDP2 shards equals clipping the whole model: `python tests/fsdp_clip.py [OUT_DIR]`.

Two gloo processes shard the template's DigitsCNN (float64) as strategy=fsdp does, each takes half of one batch
through forward and backward, and clips with Lightning's own call (`Precision.clip_grad_by_norm`, what
`trainer.gradient_clip_val` runs). One process does the same on the whole batch, unsharded. The norm over all
shards and every clipped gradient must agree to 1e-12. Also: a sharded unit with a dropout layer gives the same
gradients with `activation_checkpointing` as without (the backward recomputes the unit, drawing the same mask).
And `strategy.mixed_precision=bfloat16` trains the template's default DigitsCNN, with BatchNorm (FSDP2 casts
BatchNorm's weights, not its running statistics: the template keeps each BatchNorm in float32).
Prints the largest differences; exit 1 if any is off.
"""

import math
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from myproject.models import DigitsCNN
from scaleup.distributed.fsdp import shard

CLIP = 0.05  # well below the gradient norm (~1): clipping binds


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"net": DigitsCNN(norm="group", width=8)}).double()


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


class CountingDropout(nn.Dropout):
    """Dropout that counts its forward passes: 2 per step when the backward recomputes it."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CountingDropout.calls += 1
        return super().forward(x)


def recomputation_difference(mesh: object, x: torch.Tensor, y: torch.Tensor) -> float:
    """Largest gradient difference (this rank's shards) with and without activation checkpointing, for a unit that
    holds a dropout layer (the recomputation must draw the same mask); inf if nothing was recomputed."""
    grads, calls = [], []
    for recompute in (False, True):
        torch.manual_seed(0)
        CountingDropout.calls = 0
        block = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), CountingDropout(0.5), nn.ReLU())
        model = nn.ModuleDict({"net": nn.Sequential(block, nn.Linear(32, 10))}).double()
        shard(model, mesh, ["torch.nn.Sequential"], activation_checkpointing=recompute)  # the unit: net.0
        torch.manual_seed(5)
        F.cross_entropy(model["net"](x), y).backward()
        grads.append([p.grad.to_local() for p in model.parameters()])
        calls.append(CountingDropout.calls)
    if calls != [1, 2]:
        return float("inf")
    return max((a - b).abs().max().item() for a, b in zip(*grads, strict=True))


def bfloat16_batchnorm_loss(mesh: object, x: torch.Tensor, y: torch.Tensor) -> float:
    """The loss of one bfloat16 step of DigitsCNN with BatchNorm, sharded with mixed precision; nan if the running
    statistics did not move or the gradients are not finite."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"net": DigitsCNN(norm="batch", width=8)})
    shard(model, mesh, None, mixed_precision="bfloat16")
    norm = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    loss = F.cross_entropy(model["net"](x.float()), y)
    loss.backward()
    moved = bool(norm.running_mean.abs().sum() > 0)
    finite = all(bool(torch.isfinite(p.grad.to_local()).all()) for p in model.parameters())
    return loss.detach().item() if moved and finite else float("nan")


def worker(rank: int, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    model = build()
    shard(model, mesh, None)
    x, y = batch()
    mine = x[rank * 8 : (rank + 1) * 8], y[rank * 8 : (rank + 1) * 8]
    norm = clipped(model, *mine)
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    recomputed = recomputation_difference(mesh, *mine)
    bfloat16 = bfloat16_batchnorm_loss(mesh, *mine)
    if rank == 0:
        torch.save({"norm": norm, "grads": grads, "recomputed": recomputed, "bfloat16": bfloat16}, out)
    dist.destroy_process_group()


def main() -> int:
    out = os.path.join(sys.argv[1] if len(sys.argv) > 1 else ".", "sharded.pt")
    with socket.socket() as s:  # a free port for the process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(out, port), nprocs=2, start_method="fork")  # fork: no second import of torch
    sharded = torch.load(out, weights_only=True)
    model = build()
    norm = clipped(model, *batch())
    worst = max((sharded["grads"][name] - p.grad).abs().max().item() for name, p in model.named_parameters())
    recomputed = sharded["recomputed"]
    print(
        f"norm over all shards {sharded['norm']:.12g}, whole model {norm:.12g}; clipped gradients differ by "
        f"{worst:.1e}; activation checkpointing changes the gradients by {recomputed:.1e}; a bfloat16 step with "
        f"BatchNorm: loss {sharded['bfloat16']:.3g}"
    )
    agree = norm > CLIP and abs(sharded["norm"] - norm) < 1e-12 and worst < 1e-12 and recomputed < 1e-12
    return int(not (agree and math.isfinite(sharded["bfloat16"])))


if __name__ == "__main__":
    sys.exit(main())
