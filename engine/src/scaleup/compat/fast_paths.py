"""Speed-only fast paths through Lightning's per-step code: installed around a job's `fit` and `test`, removed after.

Each one was measured on Lightning 2.6.6 (benchmarks/README.md gives its gain in the lockstep benchmark) and
changes no result: the same hooks run in the same order on the same values. Each names the private code it
replaces (`compat/gates.py`); when that code is gone or changed in the installed Lightning, the fast path steps
aside with one warning and Lightning's own code runs. `performance.fast_paths=false` turns them all off.

While `fast_paths()` is active, `active()` is true: the template's lean subclasses (`LeanUpdateMetric`,
`LeanModelCheckpoint`) take their short cut only then, so a Trainer or a metric used outside a template job runs
Lightning's and torchmetrics' own code.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import Checkpoint, EarlyStopping, ModelCheckpoint
from lightning.pytorch.profilers import PassThroughProfiler
from torchmetrics import Metric

from scaleup.compat.gates import TESTED, Private, Workaround, installed

log = logging.getLogger("scaleup")

CALL = "lightning.pytorch.trainer.call"
RESULT = "lightning.pytorch.trainer.connectors.logger_connector.result"
DATA = "lightning.pytorch.trainer.connectors.data_connector"
_state = {"active": 0}
_warned: set[str] = set()


def active() -> bool:
    """Whether a template job's fast paths are installed (inside `fast_paths()`)."""
    return _state["active"] > 0


# --- Callback dispatch ----------------------------------------------------------------------------------------------


def _overrides(callback: Callback, hook: str) -> bool:
    """Whether `callback` does anything in `hook`: its class (or the instance itself) replaces `Callback`'s no-op."""
    return getattr(type(callback), hook, None) is not getattr(Callback, hook, None) or hook in vars(callback)


def _dispatch(lightning_call_callback_hooks: Callable[..., None]) -> Callable[..., None]:
    """Lightning's `_call_callback_hooks`, calling only the callbacks that override the hook.

    Reason: Lightning calls every hook of every callback, no-ops included, each inside a profiler context named
    after the callback's `state_key` (ModelCheckpoint builds a repr for it): about 1.6 us per callback and hook,
    9.5 us per callback and training step, with about 20 callbacks. Which callbacks override a hook is worked out
    again whenever the callback list changes. With a profiler on (`debug=profiler`) or Lightning's debug log,
    Lightning's own dispatch runs, so every hook is still timed.
    """
    cache: dict[str, tuple[tuple[Callback, ...], tuple[Callback, ...]]] = {}

    def call_overridden(
        trainer: L.Trainer, hook_name: str, *args: Any, monitoring_callbacks: bool | None = None, **kw: Any
    ) -> None:
        if lightning_dispatches(trainer):
            lightning_call_callback_hooks(trainer, hook_name, *args, monitoring_callbacks=monitoring_callbacks, **kw)
            return
        callbacks = tuple(trainer.callbacks)
        cached = cache.get(hook_name)
        if cached is None or cached[0] != callbacks:  # the same objects: an identity check per element
            cached = cache[hook_name] = (callbacks, tuple(cb for cb in callbacks if _overrides(cb, hook_name)))
        pl_module = trainer.lightning_module
        if pl_module:
            previous = pl_module._current_fx_name
            set_fx_name(pl_module, hook_name)
        for callback in cached[1]:
            if monitoring_callbacks is not None and isinstance(callback, (EarlyStopping, Checkpoint)) != (
                monitoring_callbacks
            ):
                continue
            fn = getattr(callback, hook_name)
            if callable(fn):
                fn(trainer, pl_module, *args, **kw)
        if pl_module:
            set_fx_name(pl_module, previous)

    return call_overridden


def lightning_dispatches(trainer: L.Trainer) -> bool:
    """A profiler times every hook call, and Lightning's debug log names each one: then its own dispatch runs."""
    return not isinstance(trainer.profiler, PassThroughProfiler) or logging.getLogger(CALL).isEnabledFor(logging.DEBUG)


# --- Module, strategy and DataModule hooks --------------------------------------------------------------------------


def _run_as(pl_module: L.LightningModule, hook_name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` with `pl_module._current_fx_name` set to `hook_name`, restored after (as Lightning
    does: not when `fn` raises)."""
    previous = pl_module._current_fx_name
    set_fx_name(pl_module, hook_name)
    output = fn(*args, **kwargs)
    set_fx_name(pl_module, previous)
    return output


def _module_hooks(lightning_call: Callable[..., Any]) -> Callable[..., Any]:
    """Lightning's `_call_lightning_module_hook` without its per-call debug message and profiler context.

    Reason: Lightning formats a debug message (also with debug logging off), opens a profiler context named after
    the hook and writes `_current_fx_name` through nn.Module's `__setattr__` around each call: 5-6 us, and a
    training step makes 16 such calls (training_step, backward, optimizer_step, the batch hooks, the `on_*` hooks).
    The same hooks run in the same order with the same `_current_fx_name`.
    """

    def call_module_hook(
        trainer: L.Trainer, hook_name: str, *args: Any, pl_module: L.LightningModule | None = None, **kwargs: Any
    ) -> Any:
        if lightning_dispatches(trainer):
            return lightning_call(trainer, hook_name, *args, pl_module=pl_module, **kwargs)
        pl_module = pl_module or trainer.lightning_module
        if pl_module is None:
            raise TypeError("No `LightningModule` is available to call hooks on.")
        fn = getattr(pl_module, hook_name)
        return _run_as(pl_module, hook_name, fn, *args, **kwargs) if callable(fn) else None

    return call_module_hook


def _strategy_hooks(lightning_call: Callable[..., Any]) -> Callable[..., Any]:
    """Lightning's `_call_strategy_hook`, the same way (reason: `_module_hooks`)."""

    def call_strategy_hook(trainer: L.Trainer, hook_name: str, *args: Any, **kwargs: Any) -> Any:
        if lightning_dispatches(trainer):
            return lightning_call(trainer, hook_name, *args, **kwargs)
        fn = getattr(trainer.strategy, hook_name)
        return _run_as(trainer.lightning_module, hook_name, fn, *args, **kwargs) if callable(fn) else None

    return call_strategy_hook


def _datamodule_hooks(lightning_call: Callable[..., Any]) -> Callable[..., Any]:
    """Lightning's `_call_lightning_datamodule_hook`, the same way (reason: `_module_hooks`)."""

    def call_datamodule_hook(trainer: L.Trainer, hook_name: str, *args: Any, **kwargs: Any) -> Any:
        if lightning_dispatches(trainer):
            return lightning_call(trainer, hook_name, *args, **kwargs)
        if trainer.datamodule is None:
            raise TypeError("No `LightningDataModule` is available to call hooks on.")
        fn = getattr(trainer.datamodule, hook_name)
        return fn(*args, **kwargs) if callable(fn) else None

    return call_datamodule_hook


def set_fx_name(pl_module: L.LightningModule, name: str | None) -> None:
    """`pl_module._current_fx_name = name` (the hook running, which `self.log` checks) without nn.Module's
    `__setattr__`, which looks for a parameter, buffer or submodule of that name first: 2 us a write, 0.2 us here."""
    if type(pl_module).__setattr__ is torch.nn.Module.__setattr__:
        object.__setattr__(pl_module, "_current_fx_name", name)
    else:  # a module with a __setattr__ of its own sees the write
        pl_module._current_fx_name = name


# --- Logged values --------------------------------------------------------------------------------------------------


def _held_on(metric: Any, device: torch.device) -> bool:
    """Whether what a `_ResultMetric` accumulates (its value and batch-size states, or the torchmetrics Metric it
    holds) is on `device`; False when its layout is not the one this was written for (Lightning's move runs)."""
    try:
        held = [getattr(metric, name) for name in metric._defaults] if metric.is_tensor else [metric.value]
    except AttributeError:
        return False
    return all(value is not None and getattr(value, "device", None) == device for value in held)


def _skip_redundant_moves(lightning_to: Callable[..., Any]) -> Callable[..., Any]:
    """Lightning's `_ResultMetric.to`, returning at once when there is nothing to move.

    Reason: every `self.log` call runs `_ResultMetric.to(value.device)`, which walks all of the accumulator's
    attributes and deep-copies its metadata also when nothing moves: about 1,700 Python calls, 210 us a `log` call
    on a CPU, 16 us with this. Moves to another device are Lightning's own.
    """

    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], torch.device) and _held_on(self, args[0]):
            return self
        return lightning_to(self, *args, **kwargs)

    return to


# --- Data hooks -----------------------------------------------------------------------------------------------------


def _look_up_once(lightning_get_instance: Callable[..., Any]) -> Callable[..., Any]:
    """Lightning's `_DataHookSelector.get_instance`, worked out once per hook for the selector's module and data.

    Reason: with a DataModule, every batch asks which of the two overrides each batch hook, inspecting both
    classes each time: about 120 Python calls and 11 us per batch (0.7 us with this). The answer is kept per
    selector (one per fit, validate or test) while its module and DataModule stay the same.
    """

    def get_instance(self: Any, hook_name: str) -> Any:
        owners = self.__dict__.setdefault("_owners", {})
        cached = owners.get(hook_name)
        if cached is None or cached[0] is not self.model or cached[1] is not self.datamodule:
            cached = owners[hook_name] = (self.model, self.datamodule, lightning_get_instance(self, hook_name))
        return cached[2]

    return get_instance


# --- The fast paths -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FastPath:
    """A private attribute replaced, while a job runs, by `replacement(original)`."""

    workaround: Workaround
    target: Private  # what is replaced: a module function or a class's method
    replacement: Callable[[Any], Any]

    def install(self) -> Callable[[], None]:
        """Replace the target; returns what puts Lightning's own code back."""
        owner, name = self.target.owner()
        original = vars(owner)[name]  # its own attribute: the gate checked
        setattr(owner, name, self.replacement(original))
        return lambda: setattr(owner, name, original)


def _fast_path(name: str, target: Private, replacement: Callable[[Any], Any], *also: Private) -> FastPath:
    return FastPath(Workaround(name, (target, *also)), target, replacement)


FAST_PATHS = (
    _fast_path(
        "callback dispatch (only the callbacks that override a hook)",
        Private(f"{CALL}:_call_callback_hooks", params=("trainer", "hook_name", "monitoring_callbacks")),
        _dispatch,
    ),
    _fast_path(
        "module hooks called directly",
        Private(f"{CALL}:_call_lightning_module_hook", params=("trainer", "hook_name", "pl_module")),
        _module_hooks,
    ),
    _fast_path(
        "strategy hooks called directly",
        Private(f"{CALL}:_call_strategy_hook", params=("trainer", "hook_name")),
        _strategy_hooks,
    ),
    _fast_path(
        "DataModule hooks called directly",
        Private(f"{CALL}:_call_lightning_datamodule_hook", params=("trainer", "hook_name")),
        _datamodule_hooks,
    ),
    _fast_path(
        "self.log without redundant moves",
        Private(f"{RESULT}:_ResultMetric.to", params=("self",)),
        _skip_redundant_moves,
        Private(f"{RESULT}:_ResultMetric", params=("metadata", "is_tensor")),
    ),
    _fast_path(
        "data hooks looked up once per fit",
        Private(f"{DATA}:_DataHookSelector.get_instance", params=("self", "hook_name")),
        _look_up_once,
        Private(f"{DATA}:_DataHookSelector", params=("model", "datamodule")),
    ),
)


def usable(workaround: Workaround) -> bool:
    """Whether a fast path's private code is as it was written for; if not, says so once per process."""
    problem = workaround.problem()
    if problem is not None and workaround.name not in _warned:
        _warned.add(workaround.name)
        log.warning(
            f"fast path off: {workaround.name} ({problem}; {installed()} installed, written for {TESTED}); "
            "Lightning's own code runs instead, results are the same"
        )
    return problem is None


@contextlib.contextmanager
def fast_paths(enabled: bool = True) -> Iterator[None]:
    """Install every usable fast path for the duration of the block (a job's `fit` or `test`), then remove them:
    a plain Lightning Trainer used later in the same process runs Lightning's own code."""
    undo = [path.install() for path in FAST_PATHS if enabled and usable(path.workaround)] if not active() else []
    _state["active"] += enabled
    try:
        yield
    finally:
        _state["active"] -= enabled
        for restore in reversed(undo):
            restore()


# --- Lean subclasses: their short cut runs only while a job's fast paths are active ---------------------------------


class LeanUpdateMetric(Metric):
    """A torchmetrics Metric whose `update` runs without torchmetrics' per-call wrapper work.

    torchmetrics 1.9.0. Reason: `Metric._wrap_update` wraps every `update` in a grad-mode switch and two attribute
    writes through `nn.Module.__setattr__` (each an isinstance check against Parameter and Buffer in Python): 36
    Python calls, about 5 us, per update, and a training step of the classifier makes four. Subclasses detach what
    they add to their states, so the grad-mode switch has nothing to do, and they hold no list states (which the
    wrapper may move to the CPU); the update count and the cleared `compute()` cache are kept as torchmetrics keeps
    them. Canary: test_torchmetrics_wraps_update_through_wrap_update. A fast path: only inside a template job
    (`active()`), and only while the states it writes are where torchmetrics 1.9 keeps them.
    """

    def _wrap_update(self, update: Callable[..., None]) -> Callable[..., None]:
        wrapped = super()._wrap_update(update)  # torchmetrics' own, for outside a job

        @functools.wraps(update)
        def counted_update(*args: Any, **kwargs: Any) -> None:
            state = self.__dict__  # where nn.Module.__setattr__ puts plain values
            if not active() or "_update_count" not in state:
                return wrapped(*args, **kwargs)
            state["_computed"] = None
            state["_update_count"] += 1
            update(*args, **kwargs)

        return counted_update


class LeanModelCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint, returning at once from a training batch's end when it has no trigger there.

    Lightning 2.6.6. Reason: `ModelCheckpoint.on_train_batch_end` first works out whether the trainer's state would
    allow a save (fast_dev_run, the stage as an enum comparison, sanity checking, the step last saved) and reads the
    clock, and only then finds that neither `every_n_train_steps` nor `train_time_interval` is set: about 40 Python
    calls per step, 40 us in a training step on a CPU, for each of the template's two checkpoints, which save at
    epoch ends. With a step or time trigger it runs Lightning's own check. Reads the private trigger attributes
    Lightning sets in `__init__` (`_every_n_train_steps` is 0 when unset); a fast path, only inside a template job and
    while those attributes exist.
    Canary: test_model_checkpoint_checks_the_trainer_state_on_every_batch.
    """

    @property
    def state_key(self) -> str:
        # Lightning's own key (`ModelCheckpoint{...}`), so checkpoints resume across this class and Lightning's.
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        untriggered = getattr(self, "_every_n_train_steps", 1) < 1 and getattr(self, "_train_time_interval", 0) is None
        if untriggered and active():
            return
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
