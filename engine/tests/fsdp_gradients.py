"""The gradients of FSDP2 shards as the template makes them: `python engine/tests/fsdp_gradients.py [OUT_DIR]`.

Two gloo processes shard the template's DigitsCNN (float64) as strategy=fsdp does, each takes half of one batch
through forward and backward, and clips with Lightning's own call (`Precision.clip_grad_by_norm`, what
`trainer.gradient_clip_val` runs). One process does the same on the whole batch, unsharded. The norm over all
shards and every clipped gradient must agree to 1e-12. Also: a sharded unit with a dropout layer gives the same
gradients with `activation_checkpointing` as without (the backward recomputes the unit, drawing the same mask).
And `strategy.mixed_precision=bfloat16` trains the template's default DigitsCNN, with BatchNorm (FSDP2 casts
BatchNorm's weights, not its running statistics: the template keeps each BatchNorm in float32). And accumulation
over 3 micro-batches with the sync paused for the first 2 (`gradient_sync_paused`, what the strategy does between
an optimizer step's micro-batches) gives the gradients of a sync at every micro-batch with a third of the
reduce-scatters (`sync_gradients=step`), or with hybrid sharding (a (2, 1) mesh: 2 nodes of 1 process) a third of
the all-reduces across nodes (`micro_batch`); collectives counted by torch's CommDebugMode.
Prints the largest differences; exit 1 if any is off.
"""

import contextlib
import json
import math
import os
import socket
import sys
from collections import Counter

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from scaleup.distributed.fsdp import gradient_sync_paused, shard
from testbed.models import DigitsCNN

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


def accumulated(mesh: object, x: torch.Tensor, y: torch.Tensor, whole: bool | None) -> tuple[list, dict[str, int]]:
    """This rank's gradient shards after 3 micro-batches, and the collectives per kind: synced at every
    micro-batch (`whole=None`), or paused for the first two (`whole`: as `gradient_sync_paused`)."""
    from torch.distributed.tensor.debug import CommDebugMode

    torch.manual_seed(0)  # no in-place ReLU: CommDebugMode hooks every module's output
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
    model = nn.ModuleDict({"net": net}).double()
    shard(model, mesh, None)
    counts: Counter[str] = Counter()
    for micro_batch in range(3):
        paused = whole is not None and micro_batch < 2
        # A CommDebugMode per forward: torch 2.13's stacks its module hooks on a module that runs twice inside one
        # (an IndexError on the second forward with torch 2.12 and 2.13; not with 2.14.1)
        sync = gradient_sync_paused([model["net"]], whole=bool(whole)) if paused else contextlib.nullcontext()
        with CommDebugMode() as comm, sync:
            F.cross_entropy(model["net"](x), y).backward()
        counts.update({str(op).split(".")[-1].strip("_"): n for op, n in comm.get_comm_counts().items()})
    return [p.grad.to_local() for p in model.parameters()], dict(counts)


def sync_once_per_step(mesh: object, hybrid: object, x: torch.Tensor, y: torch.Tensor) -> dict[str, object]:
    """The reduce-scatters of a full mesh and the all-reduces of a hybrid one, per micro-batch and paused; the
    largest gradient difference of each pause from syncing every micro-batch."""
    result: dict[str, object] = {}
    for name, grid, whole, kind in (
        ("step", mesh, True, "reduce_scatter_base"),
        ("micro_batch", hybrid, False, "allreduce"),
    ):
        every, every_counts = accumulated(grid, x, y, None)
        paused, paused_counts = accumulated(grid, x, y, whole)
        worst = max((a - b).abs().max().item() for a, b in zip(every, paused, strict=True))
        result[name] = {"collectives": [every_counts.get(kind, 0), paused_counts.get(kind, 0)], "worst": worst}
    return result


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
    sync = sync_once_per_step(mesh, init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard")), *mine)
    if rank == 0:
        torch.save({"norm": norm, "grads": grads, "recomputed": recomputed, "bfloat16": bfloat16, "sync": sync}, out)
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
    recomputed, sync = sharded["recomputed"], sharded["sync"]
    print(
        f"norm over all shards {sharded['norm']:.12g}, whole model {norm:.12g}; clipped gradients differ by "
        f"{worst:.1e}; activation checkpointing changes the gradients by {recomputed:.1e}; a bfloat16 step with "
        f"BatchNorm: loss {sharded['bfloat16']:.3g}; over 3 micro-batches, reduce-scatters "
        f"{sync['step']['collectives']} (every micro-batch, once), all-reduces across nodes "
        f"{sync['micro_batch']['collectives']}"
    )
    with open(os.path.join(os.path.dirname(out), "sync.json"), "w") as f:
        json.dump(sync, f)
    agree = norm > CLIP and abs(sharded["norm"] - norm) < 1e-12 and worst < 1e-12 and recomputed < 1e-12
    once = all(s["collectives"][0] == 3 * s["collectives"][1] > 0 and s["worst"] < 1e-12 for s in sync.values())
    return int(not (agree and once and math.isfinite(sharded["bfloat16"])))


if __name__ == "__main__":
    sys.exit(main())
