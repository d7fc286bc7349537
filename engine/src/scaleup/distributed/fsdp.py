"""Fully sharded data parallel (FSDP2, `torch.distributed.fsdp.fully_shard`) for any LightningModule.

Users write an ordinary LightningModule; the template shards it. The sharding units are the modules of the classes
named in `strategy.shard_modules`, or by default every block of every network the module holds (the direct children
of each network, containers such as `nn.Sequential` and `nn.ModuleList` opened into their members); then each
network as the root of its own units. Parameters, gradients and optimizer state live on each rank as 1/N of every
tensor (dim 0, padded), gathered unit by unit for the forward and backward passes and freed after.

It runs through Lightning's ModelParallelStrategy, which needs no CUDA (gloo on CPU, NCCL on GPUs) and writes
sharded checkpoints with torch.distributed.checkpoint: every rank writes its own shards, in parallel, and nothing
is gathered on rank 0 (checkpoints/sharded.py makes the write atomic and reads it on one process).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import pkgutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.optim import Optimizer

from scaleup.checkpoints.background import BackgroundSaver, split
from scaleup.checkpoints.sharded import save_sharded
from scaleup.compat.gates import ACTIVATION_CHECKPOINTING, require
from scaleup.compat.precision import model_parallel_precision
from scaleup.distributed.meta_init import (
    META,
    MetaInit,
    build_on_meta,
    materialize_outside,
    materialize_shards,
    tensors_of,
)
from scaleup.errors import UserError
from scaleup.plan.checks import BATCH_NORMS
from scaleup.plan.resolve import Plan, mib

if TYPE_CHECKING:
    from scaleup.config.schema import Strategy

log = logging.getLogger("scaleup")
BLOCKS = "name its block classes (e.g. torchvision.models.resnet.BasicBlock), or null for every block of every network"

# Modules that only hold other modules: their members are the blocks.
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def networks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The LightningModule's children that hold parameters: each is sharded as the root of its units.

    Parameters of the LightningModule's own (outside any child) would belong to no unit whose forward Lightning
    runs (it calls training_step, not forward), so they are refused.
    """
    if own := [name for name, _ in model.named_parameters(recurse=False)]:
        raise UserError(
            f"strategy=fsdp shards the networks a LightningModule holds, but {type(model).__name__} holds parameters "
            f"of its own ({', '.join(own)}): move them into a submodule (e.g. self.net)"
        )
    return [(name, child) for name, child in model.named_children() if holds_parameters(child)]


def _blocks(module: nn.Module, prefix: str) -> Iterator[str]:
    for name, child in module.named_children():
        if not holds_parameters(child):
            continue
        if isinstance(child, CONTAINERS):
            yield from _blocks(child, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def unit_names(model: nn.Module, shard_modules: Iterable[str] | None) -> list[str]:
    """Names of the modules sharded on their own, before the networks that hold them (the roots).

    `shard_modules`: dotted class names (as config holds them), or None for every block of every network.
    """
    roots = networks(model)
    if shard_modules is None:
        return [unit for root, net in roots for unit in _blocks(net, f"{root}.")]
    classes = tuple(block_class(name) for name in shard_modules)
    units = [
        f"{root}.{name}"
        for root, net in roots
        for name, module in net.named_modules()
        if name and isinstance(module, classes)  # not the network itself: it is the root
    ]
    if not units:
        raise UserError(
            f"strategy.shard_modules={list(shard_modules)} matches no module of {type(model).__name__}: {BLOCKS}"
        )
    # A unit inside another unit is sharded first (FSDP2 shards bottom-up): the innermost modules come first.
    return sorted(units, key=lambda name: -name.count("."))


def block_class(name: str) -> type:
    """The class that `name`, an entry of strategy.shard_modules, names.

    `pkgutil.resolve_name`, not `hydra.utils.get_class`: that one logs its error before raising it, and the user
    would read the message twice.
    """
    try:
        found = pkgutil.resolve_name(name)
    except (ImportError, AttributeError, ValueError) as err:
        raise UserError(f"strategy.shard_modules: cannot import {name} ({err}); {BLOCKS}") from None
    if not isinstance(found, type):
        raise UserError(f"strategy.shard_modules: {name} is not a class; {BLOCKS}")
    return found


def bytes_per_rank(model: nn.Module, world_size: int) -> tuple[int, int]:
    """(bytes of all parameters, bytes of one rank's shards): FSDP2 splits every tensor along dim 0, padded to a
    multiple of the world size. Shapes only: works on the meta device."""
    total = per_rank = 0
    for param in model.parameters():
        size = param.element_size()
        total += param.numel() * size
        rows = param.shape[0] if param.ndim else 1
        per_rank += math.ceil(rows / world_size) * (param.numel() // max(rows, 1)) * size
    return total, per_rank


@dataclass(frozen=True)
class Sharding:
    """strategy=fsdp's facts in the plan (plan.json's `sharding`; its row says them in words): the units sharded in
    order, then the roots; the mesh (nodes x devices for hybrid sharding, the world for full); the parameter bytes of
    the model and of one rank's shards; whether the model is built on the meta device (its build replayed into each
    rank's shards); when gradients are reduced (strategy.sync_gradients)."""

    key: ClassVar[str] = "sharding"
    units: tuple[str, ...]
    roots: tuple[str, ...]
    mesh: tuple[int, ...]
    parameter_bytes: int
    parameter_bytes_per_rank: int
    built_on_meta: bool
    gradient_sync: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def rows(self, plan: Plan) -> list[tuple[str, str]]:
        """The plan's `sharding` row; the gradients' part only where the plan accumulates micro-batches."""
        shown = ", ".join(self.units[:6]) + (f", ... ({len(self.units)} in all)" if len(self.units) > 6 else "")
        parts = [
            f"{len(self.units)} unit(s) ({shown or 'none'}), then the root(s) {', '.join(self.roots)}; parameters "
            f"{mib(self.parameter_bytes_per_rank)} per rank of {mib(self.parameter_bytes)} (gradients and optimizer "
            "state shard alike)",
            f"mesh {self.mesh[0]} node(s) x {self.mesh[1]}: sharded within a node, replicated across nodes"
            if len(self.mesh) == 2
            else f"mesh {self.mesh[0]}: sharded over every process",
            "built on the meta device, each rank fills its shards with the ordinary build's values"
            if self.built_on_meta
            else "every rank builds the whole model, then shards it",
        ]
        if plan.accumulate_grad_batches > 1:
            parts.append(
                f"gradients reduced once per optimizer step (whole gradients held between micro-batches: "
                f"+{mib(self.parameter_bytes)} per rank)"
                if self.gradient_sync == "step"
                else "gradients reduce-scattered at every micro-batch"
            )
        return [("sharding", "; ".join(parts))]


def batch_norms(model: nn.Module) -> list[str]:
    """Names of the BatchNorm modules with weights in the model's networks."""
    return [
        f"{root}.{name}"
        for root, net in networks(model)
        for name, module in net.named_modules()
        if isinstance(module, BATCH_NORMS) and holds_parameters(module)
    ]


def shard(
    model: nn.Module,
    mesh: Any,
    shard_modules: Iterable[str] | None,
    *,
    mixed_precision: str | None = None,
    cpu_offload: bool = False,
    activation_checkpointing: bool = False,
) -> list[str]:
    """Apply `fully_shard` to every unit, then to every network, in place. Returns the unit names (with
    mixed precision, each BatchNorm first: a unit of its own).

    Module names and parameter names stay as they were (FSDP2 swaps the parameters for DTensors in place, no
    wrapper), so checkpoints keep their plain keys.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    norms: list[str] = []
    if mixed_precision is not None:
        # Compute in the lower precision, keep float32 master weights and reduce the gradients in float32.
        low = getattr(torch, mixed_precision)
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
        norms = batch_norms(model)
        # FSDP2 casts BatchNorm's weights but not its running statistics, which batch_norm refuses: each BatchNorm
        # is a unit of its own that computes in float32 (its input cast up) and hands the lower precision on.
        norm_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=low)
        for name in norms:
            fully_shard(model.get_submodule(name), **{**kwargs, "mp_policy": norm_policy})
    units = [name for name in unit_names(model, shard_modules) if name not in norms]
    for name in units:
        unit = model.get_submodule(name)
        if activation_checkpointing:
            recompute_in_backward(unit)
        fully_shard(unit, **kwargs)
    for _, net in networks(model):
        fully_shard(net, **kwargs)
    return [*norms, *units]


def recompute_in_backward(module: nn.Module) -> None:
    """Activation checkpointing of `module`: torch's composable `checkpoint` (non-reentrant, the random state kept, so
    a dropout draws the same mask again) adds hooks to the module instead of wrapping it in another, so module and
    parameter names keep no `_checkpoint_wrapped_module.` and checkpoints their plain keys."""
    from torch.distributed._composable import checkpoint

    checkpoint(module)


def local_bytes(tensors: Iterable[Any]) -> int:
    """Bytes this rank holds of `tensors` (a DTensor's local shard; None skipped)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            total += local.numel() * local.element_size()
    return total


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What this rank holds of the model's state: parameters, gradients and optimizer state (measured)."""
    params = list(model.parameters())
    moments = [value for per_param in optimizer.state.values() for value in per_param.values()]
    return {
        "parameters": local_bytes(params),
        "gradients": local_bytes(p.grad for p in params),
        "optimizer state": local_bytes(moments),
    }


def report_model_state(mine: dict[str, int], ranks: list[dict[str, int]], total_parameters: int) -> str:
    """One line: each part as the largest rank holds it, the sum, and 1/N of the full model's parameters."""
    largest = {name: max(rank[name] for rank in ranks) for name in mine}
    parts = ", ".join(f"{name} {mib(size)}" for name, size in largest.items())
    return (
        f"model state per rank (largest of {len(ranks)}, after the first step): {parts}; {mib(sum(largest.values()))} "
        f"in all. The full model's parameters: {mib(total_parameters)}, / {len(ranks)} = "
        f"{mib(total_parameters // len(ranks))}"
    )


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def fsdp_modules(model: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def gather_for_evaluation(model: nn.Module) -> None:
    """All-gather every unit's parameters now and keep them whole through the forward passes that follow."""
    for module in fsdp_modules(model):
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()


def reshard_after_evaluation(model: nn.Module) -> None:
    """Free the gathered parameters and restore FSDP2's defaults: units reshard after their forward, roots (the
    networks, whose parameters the backward needs first) keep theirs."""
    roots = {id(net) for _, net in networks(model)}
    for module in fsdp_modules(model):
        module.reshard()
        module.set_reshard_after_forward(id(module) not in roots, recurse=False)


def mesh_shape(sharding: str, world_size: int, num_nodes: int) -> tuple[int, ...]:
    """`full`: one dimension of every rank; `hybrid`: (nodes, processes per node), which the topology always divides
    (trainer.devices per node). Hybrid on one node would be full sharding under another name: refused."""
    if sharding == "full":
        return (world_size,)
    if num_nodes < 2:
        raise UserError(
            "strategy.sharding=hybrid shards within a node and replicates across nodes, and this run has one node: "
            "use strategy.sharding=full (or trainer.num_nodes=N on N nodes)"
        )
    return (num_nodes, world_size // num_nodes)


@contextlib.contextmanager
def gradient_sync_paused(roots: list[nn.Module], *, whole: bool) -> Iterator[None]:
    """Within the block, backward passes do not reduce gradients across ranks (`whole`: not at all, each rank
    accumulates whole gradients; else only the all-reduce across the replicas of hybrid sharding waits)."""
    pause = "set_requires_gradient_sync" if whole else "set_requires_all_reduce"
    for root in roots:
        getattr(root, pause)(False)
    try:
        yield
    finally:
        for root in roots:
            getattr(root, pause)(True)


def eager_values(model: nn.Module, recording: MetaInit) -> dict[str, dict[str, Callable[[], torch.Tensor]]]:
    """Per network, each parameter's and buffer's eager value, to replay after sharding (meta tensors: by their
    recorded history, one at a time; tensors made for real: a copy now); a tensor loaded from initial weights
    (`recording.loaded`), read from its file instead."""
    values: dict[str, dict[str, Callable[[], torch.Tensor]]] = {}
    for root, net in networks(model):
        values[root] = {}
        for name, tensor in tensors_of(net):
            real = None if tensor.device == META else tensor.detach().clone()
            replayed = functools.partial(recording.value, tensor if real is None else real)
            values[root][name] = recording.loaded.get(f"{root}.{name}", replayed)
    return values


def build_recorded(build: Callable[[], nn.Module]) -> tuple[nn.Module, MetaInit | None]:
    """The model on the meta device, its construction recorded, and everything outside its networks made real;
    or, where a network's tensor cannot be replayed on its own, built eagerly, with a warning that says which."""
    state = torch.random.get_rng_state()
    model, recording = build_on_meta(build)
    nets = networks(model)
    if problem := recording.unreplayable((f"{root}.{name}", t) for root, net in nets for name, t in tensors_of(net)):
        name, why = problem
        log.warning(
            f"strategy.meta_init: {name} cannot be made shard by shard ({why}): every rank builds the whole model "
            "first (the same weights; the memory of a full copy per rank during set-up)"
        )
        torch.random.set_rng_state(state)  # the eager build draws what the recorded one drew
        return build(), None
    materialize_outside(model, [net for _, net in nets], recording)
    return model, recording


def shard_built(
    model: nn.Module,
    mesh: Any,
    shard_modules: Iterable[str] | None,
    recording: MetaInit | None,
    device: torch.device,
    options: dict[str, Any],
) -> None:
    """Shard a model built eagerly, or one built on the meta device (`recording`), whose shards are then allocated
    on `device` and filled with the eager build's values, one tensor at a time."""
    eager = eager_values(model, recording) if recording else None
    shard(model, mesh, shard_modules, **options)
    if eager is not None:
        for name, net in networks(model):
            # Offloaded shards live in host memory (FSDP2 moves them to the device for each unit's compute).
            materialize_shards(net, eager[name], torch.device("cpu") if options.get("cpu_offload") else device)


def optimizer_state_by_name(state: dict[str, Any], optimizer: Optimizer, module: nn.Module) -> dict[str, Any]:
    """`state`, as `optimizer.state_dict()` gives it (each parameter numbered in the order of the param groups), keyed
    by the parameters' names in `module`, as torch's `set_optimizer_state_dict` reads a full state; a state keyed by
    name already is returned as it is."""
    if not any(isinstance(index, int) for group in state["param_groups"] for index in group["params"]):
        return state
    names = {id(param): name for name, param in module.named_parameters()}
    order = [names[id(param)] for group in optimizer.param_groups for param in group["params"]]
    groups = [{**group, "params": [order[i] for i in group["params"]]} for group in state["param_groups"]]
    return {"state": {order[i]: value for i, value in state["state"].items()}, "param_groups": groups}


def load_one_file_checkpoint(
    path: Path, module: nn.Module, optimizers: list[Optimizer], *, strict: bool, weights_only: bool | None
) -> dict[str, Any]:
    """Load a one-file Lightning checkpoint into a sharded module and its optimizers; return the rest of it (as
    ModelParallelStrategy.load_checkpoint does: the strategy loads weights and optimizer states itself).

    Lightning 2.6 numbers a one-file checkpoint's optimizer state by the module's parameter order; torch numbers it by
    the param groups' order, so with two groups (weights, then biases and norms) every state would land on another
    parameter. Here each optimizer's own param groups name them (`optimizer_state_by_name`).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
    # Every rank maps the file; rank 0's tensors are broadcast one at a time, and each rank keeps its shard.
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    set_model_state_dict(module, checkpoint.pop("state_dict"), options=options)
    for index, optimizer in enumerate(optimizers):
        keyed = optimizer_state_by_name(checkpoint["optimizer_states"][index], optimizer, module)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=keyed, options=options)
    return checkpoint


class FSDPStrategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy, data parallel over every process, that shards the module itself.

    A module whose own `configure_model` already sharded it (DTensor parameters) is left as it is.
    Checkpoints are sharded directories, written atomically (checkpoints/sharded.py), by default in the background
    (`async_save`: checkpoint.async_save, auto or true).

    Built by strategy=fsdp's `_target_` (scaleup/conf/strategy/fsdp.yaml) with that option's keys, on 2 or more
    processes (distributed/launch.py's build_strategy gives the topology, the timeout and the meta build's recording).
    """

    def __init__(
        self,
        *,
        world_size: int,
        num_nodes: int = 1,
        shard_modules: list[str] | None = None,
        sharding: str = "full",
        sync_gradients: str = "step",
        mixed_precision: str | None = None,
        cpu_offload: bool = False,
        activation_checkpointing: bool = False,
        timeout: timedelta,
        async_save: bool | str = False,
        meta_init: bool = False,
    ) -> None:
        super().__init__(data_parallel_size=world_size, tensor_parallel_size=1, timeout=timeout)
        if activation_checkpointing:
            require(ACTIVATION_CHECKPOINTING)
        self.timeout = timeout  # the background saves' process group waits as long
        self.shard_modules = shard_modules
        self.mesh_shape = mesh_shape(sharding, world_size, num_nodes)
        self.sync_gradients = sync_gradients
        self.options = {
            "mixed_precision": mixed_precision,
            "cpu_offload": cpu_offload,
            "activation_checkpointing": activation_checkpointing,
        }
        self.meta_init = meta_init
        # The recorded build of a model made on the meta device (build_model): each rank fills its shards with the
        # values the eager build gives.
        self.recording: MetaInit | None = None
        self._background_saver: BackgroundSaver | None = None
        self._measured = False
        self._total_parameter_bytes = 0
        self.async_save = async_save in (True, "auto")  # checkpoint.async_save: auto is on here

    def build_model(self, build: Callable[[], nn.Module]) -> nn.Module:
        """The run's model, from `build`: with `meta_init` (strategy.meta_init), on the meta device with its
        construction recorded (build_recorded), else as `build` makes it."""
        if not self.meta_init:
            return build()
        model, self.recording = build_recorded(build)
        return model

    @staticmethod
    def trainer_precision(precision: str) -> tuple[str | None, list[Any]]:
        """(Trainer's `precision`, precision plugins) for the planned `precision` (compat/precision.py: Lightning
        refuses the float64 flag with this strategy, and takes the plugin)."""
        return model_parallel_precision(precision)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The optimizer step; after the run's first, every rank measures what it holds (gradients still there)."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if not self._measured:
            self._measured = True
            inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
            mine = model_state_bytes(self.lightning_module, inner)
            ranks: list[Any] = [None] * self.world_size
            torch.distributed.all_gather_object(ranks, mine)  # the first step: every rank is here
            if self.is_global_zero:
                log.info(report_model_state(mine, ranks, self._total_parameter_bytes))
        return output

    def setup(self, trainer: Any) -> None:
        """Shard the module, then set it up as every Lightning strategy does (`Strategy.setup`: precision, device,
        optimizers). A module with a `configure_model` of its own gets ModelParallelStrategy's setup instead.

        ModelParallelStrategy.setup (Lightning 2.6) refuses a LightningModule that does not override `configure_model`,
        where Lightning expects the parallelism applied; here users keep ordinary modules, and what else it does
        (fill meta tensors by `reset_parameters`, a barrier) the sharding has done: no meta tensor is left.
        Canary: test_model_parallel_strategy_refuses_a_module_without_configure_model.
        """
        model = self.lightning_module
        self._total_parameter_bytes = bytes_per_rank(model, 1)[0]
        if not is_sharded(model):  # sharded already: by its own configure_model, or by an earlier stage (fit, test)
            shard_built(model, self.sharding_mesh(), self.shard_modules, self.recording, self.root_device, self.options)
            self.recording = None  # the history holds constants: free them
        if is_overridden("configure_model", model):
            super().setup(trainer)
        else:
            Strategy.setup(self, trainer)

    def plan_record(self, model: nn.Module, *, on_meta: bool) -> Sharding:
        """The plan's record of how this strategy shards `model` (`on_meta`: built on the meta device): its units and
        roots, the parameter bytes of the model and of one rank's shards. The plan asks the launch's strategy for it
        (plan/make.py)."""
        total, per_rank = bytes_per_rank(model, self.mesh_shape[-1])
        units, roots = tuple(unit_names(model, self.shard_modules)), tuple(name for name, _ in networks(model))
        return Sharding(units, roots, self.mesh_shape, total, per_rank, on_meta, self.sync_gradients)

    def sharding_mesh(self) -> Any:
        """The mesh `fully_shard` shards over: every rank (1-D), or (nodes, processes per node) for hybrid sharding,
        each node holding one whole copy, sharded over its processes, and the copies kept equal by all-reducing the
        gradients across nodes."""
        if len(self.mesh_shape) == 1:
            return self.device_mesh["data_parallel"]
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.root_device.type, self.mesh_shape, mesh_dim_names=("replicate", "shard"))

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """The micro-batches before an optimizer step's last: with `sync_gradients=step` no gradient leaves the rank
        (each rank holds its whole gradient until the last micro-batch reduce-scatters it once); with `micro_batch`
        each micro-batch reduce-scatters within the node, and only the all-reduce across the nodes of hybrid sharding
        waits for the last. (Lightning's own only pauses a DDP-wrapped model.)"""
        roots = [net for _, net in networks(self.lightning_module)]
        with gradient_sync_paused(roots, whole=self.sync_gradients == "step"):
            yield

    # Evaluation batches are uneven across ranks (every sample counted once, no padding), and a sharded forward
    # all-gathers every unit: a rank with one batch more would wait for the others forever. So evaluation gathers
    # the parameters once, on every rank together, runs with them whole (parameters only: no gradients, no
    # optimizer state), and frees them after.
    def on_validation_start(self) -> None:
        super().on_validation_start()
        gather_for_evaluation(self.lightning_module)

    def on_validation_end(self) -> None:
        reshard_after_evaluation(self.lightning_module)
        super().on_validation_end()

    def on_test_start(self) -> None:
        super().on_test_start()
        gather_for_evaluation(self.lightning_module)

    def on_test_end(self) -> None:
        reshard_after_evaluation(self.lightning_module)
        super().on_test_end()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded checkpoint (a directory) as Lightning loads it; a one-file checkpoint (DDP's, or one process's)
        by `load_one_file_checkpoint`: Lightning 2.6 would key its optimizer state by module order."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if path.is_dir():
            return super().load_checkpoint(path, weights_only=weights_only)
        strict = self.lightning_module.strict_loading
        return load_one_file_checkpoint(path, self.model, self.optimizers, strict=strict, weights_only=weights_only)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Every rank writes its shards into a temporary directory beside `filepath`; rank 0 then swaps it in. With
        `async_save`, the state is copied now and written in the background (checkpoints/background.py)."""
        path = Path(self.broadcast(str(filepath)))
        if self.async_save:
            self.background_saver().save(*split(checkpoint), path, is_global_zero=self.is_global_zero)
            return
        save_sharded(
            path,
            lambda tmp: super(FSDPStrategy, self).save_checkpoint(checkpoint, tmp, storage_options),
            is_global_zero=self.is_global_zero,
            barrier=self.barrier,
        )

    def background_saver(self) -> BackgroundSaver:
        """The saves of `async_save`, one in flight at a time, over a process group of their own; made at the first
        save."""
        if self._background_saver is None:
            self._background_saver = BackgroundSaver(timeout=self.timeout)
        return self._background_saver

    def remove_checkpoint(self, filepath: Any) -> None:
        """With `async_save`, a checkpoint replaced by a newer one (ModelCheckpoint's previous best) goes once the
        newer one is in place: a crash in between leaves one of them."""
        if not self.async_save:
            super().remove_checkpoint(filepath)
        elif self.is_global_zero:
            self.background_saver().then(lambda: super(FSDPStrategy, self).remove_checkpoint(filepath))

    def teardown(self) -> None:
        """The save in flight is in place before the stage ends, also one that an exception or SIGTERM stopped
        (which saves last.ckpt on its way out): `test` and the next run read whole checkpoints."""
        if self.async_save:
            self.background_saver().wait()
        super().teardown()
