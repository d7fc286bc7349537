"""Starting and stopping processes the way Lightning's launchers do not: spawn workers that leave the process group
together, and the template's SIGTERM handler kept in front of Lightning's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.pytorch.strategies import DDPStrategy


@functools.cache
def _clean_exit_launcher_class() -> type:
    """Lightning's spawn launcher, whose workers run `on_exit` (leave the process group together) before they exit.

    Lightning 2.6.6. Reason: Lightning's spawn worker function returns with the process group still up and has no
    hook after it; a worker that exits while its peer still holds gloo connections can abort ("terminate called
    without an active exception", seen at the end of a spawned test). Subclasses a private Lightning class, so the
    class is made when a spawn run needs it (gates.SPAWN_LAUNCHER checks it first), under this module's name, which
    pickle finds through the module's `__getattr__` in the spawned workers too.
    Canary: test_spawn_worker_leaves_the_process_group_up.
    """
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    class CleanExitLauncher(_MultiProcessingLauncher):
        def __init__(self, strategy: Any, start_method: str, on_exit: Callable[[], None]) -> None:
            super().__init__(strategy, start_method=start_method)
            self.on_exit = on_exit  # a module-level function: spawn pickles it into every worker

        def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
            super()._wrapping_function(*args, **kwargs)
            self.on_exit()

    CleanExitLauncher.__module__, CleanExitLauncher.__qualname__ = __name__, "CleanExitLauncher"
    return CleanExitLauncher


def __getattr__(name: str) -> Any:
    if name == "CleanExitLauncher":
        return _clean_exit_launcher_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class SpawnDDPStrategy(DDPStrategy):
    """DDPStrategy(start_method="spawn") with the CleanExitLauncher (same Lightning version, reason and canary)."""

    def __init__(self, *, on_exit: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(start_method="spawn", **kwargs)
        self.on_exit = on_exit

    def _configure_launcher(self) -> None:
        self._launcher = _clean_exit_launcher_class()(self, self._start_method, self.on_exit)


def keep_sigterm_handler(trainer: L.Trainer, install: Callable[[], None]) -> None:
    """Calls `install` (which puts our SIGTERM handler back) right after Lightning registers its own, as each of
    `trainer`'s stages starts.

    Lightning 2.6.6. Reason: the private `_SignalConnector.register_signal_handlers` puts Lightning's SIGTERM
    handler (a broadcast inside the handler, a stop of its own rank alone) in front of ours after `setup`, and
    a stage's first callback hook comes only after the process group's barrier and the loaders' setup: a signal
    in between would reach Lightning's. Its SIGUSR1 handler (SLURM's requeue) is left as it is.
    Canary: test_lightning_registers_its_own_sigterm_handler_after_setup.
    """
    connector = trainer._signal_connector
    register = connector.register_signal_handlers

    def register_then_install() -> None:
        register()
        install()

    connector.register_signal_handlers = register_then_install
