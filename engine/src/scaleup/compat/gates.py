"""What the template needs of Lightning's (and torch's, torchmetrics') private code, checked before it is used.

A workaround names each private thing it relies on (`Private`: a module attribute, or a class's attribute or
method, with the parameters it must take) and the versions it was written and tested for. Nothing private is
imported when the engine is: `Workaround.problem()` imports and inspects when a job asks, so a Lightning release
that drops a name breaks no import. What a failed check does depends on the workaround:

- a correctness workaround refuses to start in one line (`require`), naming the tested range and what to do;
- a few have a public fallback that gives the same result (the precision spellings, the optimizer parser).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

from scaleup.errors import UserError

#: The releases every workaround here was written and tested for; pyproject.toml caps Lightning and torchmetrics
#: below their next minor release, and constraints.txt pins the exact versions the suite passed on.
TESTED = "Lightning 2.6 (2.6.0 to 2.6.6), torchmetrics 1.9, torch 2.14"
INSTALL_TESTED = 'python -m pip install -c constraints.txt -e ".[test]"'


@dataclass(frozen=True)
class Private:
    """A private name: `module:attr.attr` (an attribute of the module, or of a class in it: defined by that class
    itself, not inherited), and the parameters it must take."""

    path: str
    params: tuple[str, ...] = ()

    def resolve(self) -> Any:
        module, _, attrs = self.path.partition(":")
        found: Any = importlib.import_module(module)
        for attr in attrs.split(".") if attrs else ():
            found = vars(found)[attr] if isinstance(found, type) else getattr(found, attr)
        return found

    def owner(self) -> tuple[Any, str]:
        """(the module or class holding the name, the name's last part): where it is replaced or removed."""
        module, _, attrs = self.path.partition(":")
        *owner, name = attrs.split(".")
        return Private(f"{module}:{'.'.join(owner)}" if owner else module).resolve(), name

    def problem(self) -> str | None:
        """What is gone or changed, or None."""
        try:
            found = self.resolve()
        except (ImportError, AttributeError, KeyError):
            return f"{self.path} is gone"
        if self.params:
            target = found.fget if isinstance(found, property) else getattr(found, "__func__", found)
            try:
                parameters = inspect.signature(target).parameters
            except (TypeError, ValueError):
                return f"{self.path} has no signature to check"
            if missing := [name for name in self.params if name not in parameters]:
                return f"{self.path} takes no {', '.join(missing)} any more"
        return None


@dataclass(frozen=True)
class Workaround:
    """A place where the template relies on private code: its name, and what it needs."""

    name: str
    needs: tuple[Private, ...]

    def problem(self) -> str | None:
        return next((problem for private in self.needs if (problem := private.problem()) is not None), None)


def installed() -> str:
    return f"Lightning {version('lightning')}, torchmetrics {version('torchmetrics')}, torch {version('torch')}"


def require(*workarounds: Workaround) -> None:
    """Refuse to start, in one line, when a correctness workaround's private code is gone or changed."""
    for workaround in workarounds:
        if (problem := workaround.problem()) is not None:
            raise UserError(
                f"{workaround.name} relies on Lightning internals that changed ({problem}; {installed()} installed, "
                f"the template is tested with {TESTED}): install the tested versions with `{INSTALL_TESTED}`"
            )


#: Private names with a public fallback that gives the same result: used where present, never checked.
WITH_FALLBACK = (
)

# --- The correctness workarounds, checked before a job that uses them starts ----------------------------------------

RESULT = "lightning.pytorch.trainer.connectors.logger_connector.result"
EXACT_EVAL = Workaround(
    "exact evaluation metrics (ExactEvalMetrics)",
    (
        Private("lightning.pytorch:Trainer._results"),
        Private(f"{RESULT}:_ResultMetric", params=("metadata", "is_tensor")),
        Private(f"{RESULT}:_ResultMetric.compute"),
        Private(f"{RESULT}:_Metadata", params=("fx", "name")),
    ),
)
SPAWN_LAUNCHER = Workaround(
    "strategy.name=ddp_spawn (CleanExitLauncher)",
    (
        Private("lightning.pytorch.strategies.launchers.multiprocessing:_MultiProcessingLauncher._wrapping_function"),
        Private("lightning.pytorch.strategies:DDPStrategy._configure_launcher"),
    ),
)
EMA_DEVICE = Workaround(
    "callbacks=ema (EMA)", (Private("lightning.pytorch.callbacks:EMAWeightAveraging.__init__", params=("device",)),)
)
FSDP_OPTIMIZER_KEYS = Workaround(
    "strategy=fsdp resuming a one-file checkpoint (optimizer_states_keyed_in_group_order)",
    (
        Private(
            "lightning.fabric.strategies.model_parallel:_rekey_optimizer_state_if_needed",
            params=("optimizer_state_dict", "module"),
        ),
    ),
)
SIGTERM_HANDLER = Workaround(
    "the SIGTERM take-over (keep_sigterm_handler)",
    (Private("lightning.pytorch.trainer.connectors.signal_connector:_SignalConnector.register_signal_handlers"),),
)
EPOCH_END_RESUME = Workaround(
    "trainer.max_steps (LoopRepairs)",
    (Private("lightning.pytorch.loops.fit_loop:_FitLoop._iteration_based_training"),),
)
CORRECTNESS = (EXACT_EVAL, SIGTERM_HANDLER, SPAWN_LAUNCHER, EMA_DEVICE, FSDP_OPTIMIZER_KEYS, EPOCH_END_RESUME)
