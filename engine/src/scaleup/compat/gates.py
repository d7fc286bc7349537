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


@dataclass(frozen=True)
class PrivateUse:
    """Why the engine touches one private upstream name: where, the guarantee it serves, the upstream behaviour it
    works around, and the test that fails when that behaviour changes (its canary)."""

    where: str
    guarantee: str
    upstream: str
    canary: str


META_REPLAY = PrivateUse(
    "distributed/meta_init.py",
    "strategy=fsdp builds a model on the meta device whose shards hold the eager build's values bit for bit",
    "torch records operations only through TorchDispatchMode, whose module is private, and names the arguments an "
    "operation writes only in OpOverload._schema; torchmetrics moves its states only in Module._apply",
    "test_the_replayed_build_equals_the_ordinary_build_bit_for_bit",
)
SIGTERM_TAKE_OVER = PrivateUse(
    "compat/lightning_2_6.py",
    "the template's SIGTERM handler stays in front of Lightning's from a stage's start",
    "Lightning registers its own SIGTERM handler after setup, through Trainer._signal_connector: a subclass of its "
    "_SignalConnector puts the template's back",
    "test_lightning_registers_its_own_sigterm_handler_after_setup",
)
HYDRA_APP = PrivateUse(
    "config/composition.py",
    "a mistake in the command line's overrides is one line and exit code 2, also under -m",
    "@hydra.main reports a composition error itself (exit 1) unless HYDRA_FULL_ERROR is set: run_app runs the steps "
    "@hydra.main runs (Hydra, its search path, run_and_report) so that they raise",
    "test_entry_point_exits_2_with_one_line",
)
EXACT_METRICS = PrivateUse(
    "callbacks/exact_metrics.py",
    "validation and test metrics of a plain self.log on N processes equal those on one",
    "Lightning keeps each rank's own epoch value, and truncates a sync_dist mean's sample count",
    "test_plain_self_log_keeps_each_rank_its_own_epoch_value",
)

#: Every private name of torch, Lightning, Hydra, Optuna or torchmetrics that the engine's source touches (an
#: attribute, an imported name or module, or a method or attribute of an upstream class it subclasses), and why.
#: test_compat.py scans the source and asserts that what it finds is exactly this. A new one needs a guarantee that
#: no public API gives, a canary in engine/tests/test_lightning_workarounds.py (or the feature's own test), an entry
#: here and a row in docs/lightning-workarounds.md.
PRIVATE_NAMES = {
    "_results": EXACT_METRICS,
    "_computed": EXACT_METRICS,
    "_signal_connector": SIGTERM_TAKE_OVER,
    "_SignalConnector": SIGTERM_TAKE_OVER,
    "hydra._internal.hydra": HYDRA_APP,
    "hydra._internal.utils": HYDRA_APP,
    "_FitLoop": PrivateUse(
        "compat/lightning_2_6.py",
        "a resume with trainer.max_steps from an epoch-end checkpoint trains what a resume without max_steps trains",
        "with max_steps, Lightning's fit loop re-enters a finished epoch: its restarting setter is fixed in a subclass",
        "test_max_steps_resume_from_an_epoch_end_reenters_the_finished_epoch",
    ),
    "torch.distributed._composable": PrivateUse(
        "distributed/fsdp.py",
        "strategy.activation_checkpointing=true recomputes each unit under its own names: checkpoint keys stay plain",
        "torch checkpoints a module without wrapping it in another (whose `_checkpoint_wrapped_module.` enters every "
        "parameter's name) only through torch.distributed._composable.checkpoint",
        "test_composable_checkpoint_recomputes_a_module_under_its_own_names",
    ),
    "torch.utils._python_dispatch": META_REPLAY,
    "_schema": META_REPLAY,
    "_apply": META_REPLAY,
}

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
EMA_DEVICE = Workaround(
    "a weight-averaging callback, e.g. callbacks=ema (trainer.py's on_training_device)",
    (Private("lightning.pytorch.callbacks:WeightAveraging.__init__", params=("device",)),),
)
ACTIVATION_CHECKPOINTING = Workaround(
    "strategy.activation_checkpointing (recompute_in_backward)",
    (Private("torch.distributed._composable:checkpoint", params=("module",)),),
)
SIGTERM_HANDLER = Workaround(
    "the SIGTERM take-over (SignalConnector)",
    (Private("lightning.pytorch.trainer.connectors.signal_connector:_SignalConnector.register_signal_handlers"),),
)
EPOCH_END_RESUME = Workaround(
    "trainer.max_steps (LoopRepairs)",
    (Private("lightning.pytorch.loops.fit_loop:_FitLoop.restarting"),),
)
CORRECTNESS = (EXACT_EVAL, SIGTERM_HANDLER, EMA_DEVICE, EPOCH_END_RESUME, ACTIVATION_CHECKPOINTING)
