"""A model built on the meta device whose shards get exactly the values an ordinary (eager) build gives.

With `strategy=fsdp` every rank would otherwise build the whole model in host memory before sharding it: 8 ranks
of a node each holding a full float32 copy of a 7B model is 224 GB before one shard exists. Here the user's
unchanged LightningModule is built on the meta device (shapes only, no memory) while every tensor operation of
its construction is recorded; after sharding, each rank replays the recorded history one tensor at a time, in
full, on the CPU, and keeps only its own slice. The peak is the rank's shards plus the largest single tensor.

Why not re-run each module's `reset_parameters()` on the shards (Lightning's and torchtitan's way)? The values
would differ from the eager build: the random draws happen in another order (that of `modules()`, not of the
constructor's code), init code outside `reset_parameters` (an `nn.init` loop, `torch.randn(...) * 0.02`) is lost,
and on CPU meshes DTensor's random ops draw per shard. The replay draws every random number from the generator
state it had at that point of the eager build (recording draws them too, on scratch tensors, so that the generator
moves as in the eager build), so 1 DDP process and N FSDP processes start from the same weights, bit for bit.

A tensor whose history cannot be replayed on its own (an operation that writes two tensors, a tensor never written
after `torch.empty`, which is what an init function that skips meta tensors leaves) is reported by
`MetaInit.unreplayable`: the caller then builds the model eagerly and says which tensor.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

META = torch.device("meta")
CPU = torch.device("cpu")
# torch.nn.init's functions that return at once for a meta tensor (they draw through temporaries and copies, and
# trunc_normal_ draws until its values fit): recorded as one write each, the function itself replayed
# (`InitsSkippingMeta`), found by their code.
SKIPPING_META = {f.__code__: f for f in (nn.init.trunc_normal_, nn.init.orthogonal_, nn.init.sparse_, nn.init.dirac_)}
IS_META = torch.Tensor.is_meta.__get__  # what a TorchFunctionMode sees when code reads `tensor.is_meta`
EMPTY = ("aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default", "aten.new_empty.default")


def storage_key(tensor: torch.Tensor) -> StorageWeakRef:
    """Tensors that share memory (a parameter, the tensor it wraps, its views) share this key (equal and hashed by
    the storage itself, which it keeps from being reused while it exists)."""
    return StorageWeakRef(tensor.untyped_storage())


def tree_leaves(tree: Any) -> Iterator[Any]:
    """The leaves of nested lists, tuples and dicts (an operation's arguments), in order."""
    if type(tree) in (list, tuple):
        for item in tree:
            yield from tree_leaves(item)
    elif type(tree) is dict:
        for item in tree.values():
            yield from tree_leaves(item)
    else:
        yield tree


def tree_map(function: Callable[[Any], Any], tree: Any) -> Any:
    """`tree` with `function` applied to each leaf, its lists, tuples and dicts rebuilt."""
    if type(tree) in (list, tuple):
        return type(tree)(tree_map(function, item) for item in tree)
    if type(tree) is dict:
        return {key: tree_map(function, value) for key, value in tree.items()}
    return function(tree)


@dataclass(frozen=True)
class Ref:
    """A meta tensor as an argument: a view of a recorded storage as it was after `version` writes."""

    key: StorageWeakRef
    version: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class Call:
    """One recorded operation (an aten op, or one of torch.nn.init's functions): meta tensors among its arguments
    are `Ref`s, real ones constants."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng_state: torch.Tensor | None = None  # the generator's state before a random op draws
    output: int | None = None  # which output of a multi-output op


@dataclass
class History:
    """A storage: the call that made it and the in-place writes into (views of) it since, in order."""

    source: Call
    writes: list[tuple[Ref, Call]] = field(default_factory=list)
    unreplayable: str | None = None  # why not, where an operation cannot be replayed on this storage alone


class Unreplayable(Exception):
    """A recorded history that cannot be replayed on its own."""


UNKNOWN = object()  # a meta tensor argument with no recorded history


def written_arguments(func: Any) -> list[int]:
    return [i for i, arg in enumerate(func._schema.arguments) if arg.alias_info is not None and arg.alias_info.is_write]


def is_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device == META


def generator_of(kwargs: dict[str, Any]) -> torch.Generator:
    return kwargs.get("generator") or torch.default_generator


class MetaInit(TorchDispatchMode):
    """Records, while active, every operation that makes or reads a meta tensor (use with `torch.device("meta")`):
    what each storage was made from and every write into it. Random draws move the real CPU generator as the eager
    build would."""

    def __init__(self) -> None:
        super().__init__()
        self.histories: dict[StorageWeakRef, History] = {}
        self.broken: str | None = None  # a random draw that could not be reproduced: no later draw can be trusted
        # Tensors whose values come from elsewhere (init.weights: finetune.py), by name in the LightningModule: read
        # one at a time in place of the replay when the shards are filled.
        self.loaded: dict[str, Callable[[], torch.Tensor]] = {}

    # Recording ------------------------------------------------------------------------------------------------------

    def _ref(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if not is_meta(value):
            return value.detach().clone()  # a real tensor (torch.tensor(...) data): a constant of the history
        history = self.histories.get(storage_key(value))
        if history is None:  # made before recording began: nothing to replay
            return UNKNOWN
        size, stride = tuple(value.size()), tuple(value.stride())
        return Ref(storage_key(value), len(history.writes), size, stride, value.storage_offset())

    def _call(self, func: Any, args: tuple, kwargs: dict[str, Any], random: bool) -> Call:
        state = generator_of(kwargs).get_state() if random else None
        return Call(func, tree_map(self._ref, args), tree_map(self._ref, kwargs), state)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not any(is_meta(leaf) or leaf == META for leaf in tree_leaves((args, kwargs))):
            return func(*args, **kwargs)  # real tensors only (an advance's scratch work): nothing to record
        random = torch.Tag.nondeterministic_seeded in func.tags
        call = self._call(func, args, kwargs, random)
        out = func(*args, **kwargs)
        if written := written_arguments(func):
            self._record_write(call, args, kwargs, written)
        elif not func.is_view:
            outputs = out if isinstance(out, (tuple, list)) else (out,)
            for index, tensor in enumerate(outputs):
                if is_meta(tensor) and storage_key(tensor) not in self.histories:
                    output = index if isinstance(out, (tuple, list)) else None
                    source = Call(func, call.args, call.kwargs, call.rng_state, output)
                    self.histories[storage_key(tensor)] = History(source)
        if random:
            self._advance(call, args[0] if written_arguments(func) else None)
        return out

    def _record_write(self, call: Call, args: tuple, kwargs: dict[str, Any], written: list[int]) -> None:
        schema = call.func._schema.arguments
        targets = [args[i] if i < len(args) else kwargs.get(schema[i].name) for i in written]
        histories = [self.histories.get(storage_key(t)) for t in targets if is_meta(t)]
        if written != [0] or UNKNOWN in tree_leaves((call.args, call.kwargs)):
            for history in filter(None, histories):
                history.unreplayable = f"{call.func}: it writes two tensors, or reads one made before the build"
        elif histories and histories[0] is not None:
            histories[0].writes.append((self._ref(targets[0]), call))

    def _advance(self, call: Call, target: torch.Tensor | None) -> None:
        """Draw what the eager build draws here, on real tensors, and throw the result away: an in-place draw into a
        scratch tensor of the target's layout (the layout decides how CPU kernels draw), any other for real."""
        try:
            if target is None:
                self.run(call)
            else:
                scratch = torch.empty_strided(target.size(), target.stride(), dtype=target.dtype, device=CPU)
                self.run(call, target=scratch)
        except Unreplayable as err:
            # Every later draw would start from the wrong state: nothing recorded from here on is the eager value.
            self.broken = self.broken or f"{call.func} draws from a tensor that cannot be replayed ({err})"

    def record_init(self, function: Callable[..., torch.Tensor], tensor: torch.Tensor, kwargs: dict[str, Any]) -> None:
        """A call `function(tensor, **kwargs)` of one of torch.nn.init's functions that skip meta tensors, recorded as
        a write of the whole function into `tensor`."""
        history = self.histories.get(storage_key(tensor))
        if history is None:  # made before recording began: left unwritten, as the function leaves it
            return
        call = self._call(function, (tensor,), kwargs, random=True)
        history.writes.append((self._ref(tensor), call))
        self._advance(call, tensor)

    # Replaying ------------------------------------------------------------------------------------------------------

    def run(self, call: Call, target: torch.Tensor | None = None) -> Any:
        """Execute a recorded call on real CPU tensors (`target`: the tensor an in-place call writes into)."""
        args = tree_map(self._value, call.args)
        kwargs = tree_map(self._value, call.kwargs)
        if target is not None:
            args = (target, *args[1:])
        if call.rng_state is not None:
            generator_of(kwargs).set_state(call.rng_state)
        out = call.func(*args, **kwargs)
        return out[call.output] if call.output is not None else out

    def _value(self, value: Any) -> Any:
        if value is UNKNOWN:
            raise Unreplayable("an argument made before the build")
        if isinstance(value, torch.device) and value == META:
            return CPU
        if not isinstance(value, Ref):
            return value
        return self.storage(value.key, value.version).as_strided(value.size, value.stride, value.offset)

    def storage(self, key: StorageWeakRef, version: int | None = None) -> torch.Tensor:
        """The real tensor a recorded storage held after `version` writes (all, by default)."""
        history = self.histories[key]
        if history.unreplayable:
            raise Unreplayable(history.unreplayable)
        base = self.run(history.source)
        for ref, call in history.writes[:version]:
            self.run(call, target=base.as_strided(ref.size, ref.stride, ref.offset))
        return base

    def value(self, tensor: torch.Tensor) -> torch.Tensor:
        """What a tensor of the recorded build holds in the eager build: a real CPU tensor (a meta one replayed)."""
        if not is_meta(tensor):
            return tensor.detach().clone()
        if storage_key(tensor) not in self.histories:
            raise Unreplayable("a tensor made before the build")
        with torch.no_grad(), keep_generator_state():
            full = self.storage(storage_key(tensor))
            view = full.as_strided(tensor.size(), tensor.stride(), tensor.storage_offset())
            # A view of part of a larger storage is copied, so that the rest can be freed.
            return view if view.numel() == full.numel() else view.clone()

    def unreplayable(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, str] | None:
        """(name, why) of the first tensor whose history cannot be replayed on its own, else None."""
        for name, tensor in tensors:
            if self.broken:
                return name, self.broken
            if not is_meta(tensor):
                continue
            if storage_key(tensor) not in self.histories:
                return name, "made before the build"
            if reason := self._why_not(storage_key(tensor), set()):
                return name, reason
        return None

    def _why_not(self, key: StorageWeakRef, seen: set[StorageWeakRef]) -> str | None:
        """Why the storage `key`, or one it is computed from, cannot be replayed; None if it can."""
        seen.add(key)
        history = self.histories[key]
        if history.unreplayable:
            return history.unreplayable
        if str(history.source.func) in EMPTY and not history.writes:
            return (
                "it is never written after torch.empty on the meta device: an init that returns at once for a meta "
                "tensor (other than torch.nn.init's, which are recorded)"
            )
        calls = [history.source, *(call for _, call in history.writes)]
        for arg in tree_leaves([(call.args, call.kwargs) for call in calls]):
            if arg is UNKNOWN:
                return "it reads a tensor made before the build"
            if isinstance(arg, Ref) and arg.key not in seen and (reason := self._why_not(arg.key, seen)):
                return reason
        return None


class TensorsFromData(TorchFunctionMode):
    """`torch.tensor(data)` on the meta device would drop the data and leave no operation to record: such tensors
    (BatchNorm's `num_batches_tracked`, torchmetrics' states, class weights) are small, so they are made for real,
    on the CPU."""

    FROM_DATA = (torch.tensor, torch.as_tensor, torch.asarray)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in self.FROM_DATA and kwargs.get("device") in (None, META):
            kwargs = {**kwargs, "device": CPU}
        return func(*args, **kwargs)


@contextlib.contextmanager
def keep_generator_state() -> Iterator[None]:
    """Replays set the default generator to recorded states; put back the one the process had."""
    state = torch.default_generator.get_state()
    try:
        yield
    finally:
        torch.default_generator.set_state(state)


class InitsSkippingMeta(TorchFunctionMode):
    """Records the calls of torch.nn.init's functions that return at once for a meta tensor (`SKIPPING_META`): each
    asks `tensor.is_meta` first (trunc_normal_ through the helper it calls), which this mode sees. The function's
    arguments are read from its frame, and the call is recorded as one write (`MetaInit.record_init`); the function
    then returns as it does for any meta tensor."""

    def __init__(self, recording: MetaInit) -> None:
        super().__init__()
        self.recording = recording

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func == IS_META and func(*args):
            caller = inspect.currentframe().f_back
            # The caller, or (trunc_normal_) the caller's caller.
            for frame in (caller, caller.f_back):
                if (function := SKIPPING_META.get(frame.f_code)) is not None:
                    called = {name: frame.f_locals[name] for name in inspect.signature(function).parameters}
                    self.recording.record_init(function, called.pop("tensor"), called)
                    break
        return func(*args, **kwargs)


def build_on_meta(build: Callable[[], nn.Module]) -> tuple[nn.Module, MetaInit]:
    """`build()` on the meta device, recorded."""
    recording = MetaInit()
    with torch.device(META), TensorsFromData(), recording, InitsSkippingMeta(recording):
        model = build()
    return model, recording


def tensors_of(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]


def materialize_outside(model: nn.Module, networks: list[nn.Module], recording: MetaInit) -> None:
    """Give every meta tensor of `model` outside `networks` its eager value, in full, now: the state of the modules
    that are not sharded (metrics: torchmetrics moves its states and defaults in `_apply`, the hook behind `.to()`),
    and the LightningModule's own tensors."""
    inside = {id(net) for net in networks}

    def replay(tensor: torch.Tensor) -> torch.Tensor:
        return recording.value(tensor) if is_meta(tensor) else tensor

    for child in model.children():
        if id(child) not in inside:
            child._apply(replay)
    for name, value in [*vars(model).items(), *model.named_buffers(recurse=False)]:
        if is_meta(value):
            setattr(model, name, replay(value))


def local_part(full: torch.Tensor, dtensor: Any) -> torch.Tensor:
    """This rank's slice of `full` as `dtensor` lays it out (Shard: torch.chunk along the dim, per mesh dim)."""
    local, coordinate = full, dtensor.device_mesh.get_coordinate()
    for mesh_dim, placement in enumerate(dtensor.placements):
        if placement.is_shard():
            chunks = torch.chunk(local, dtensor.device_mesh.size(mesh_dim), dim=placement.dim)
            index = coordinate[mesh_dim]
            local = chunks[index] if index < len(chunks) else local.narrow(placement.dim, 0, 0)
    return local


def materialize_shards(net: nn.Module, values: dict[str, Callable[[], torch.Tensor]], device: torch.device) -> None:
    """After sharding: allocate `net`'s shards on `device` and fill each with its slice of the eager value.

    `values`: parameter and buffer name -> the eager value, called one tensor at a time so that only one full
    tensor is in memory at once.
    """
    from torch.distributed.tensor import DTensor

    net.to_empty(device=device)
    with torch.no_grad():
        for name, tensor in tensors_of(net):
            full = values[name]().to(tensor.dtype)
            if isinstance(tensor, DTensor):
                local = local_part(full, tensor)
                assert local.shape == tensor.to_local().shape, (name, local.shape, tensor.to_local().shape)
                tensor.to_local().copy_(local)
            else:
                tensor.copy_(full)
