"""Starting and stopping processes the way Lightning's launchers do not: spawn workers that leave the process group
together, and meet on a port that is free at each launch.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy

# The ports this process's launches chose (not MASTER_PORT as you set it): each launch checks its own again.
CHOSEN: set[int] = set()


class LeaveProcessGroup(Callback):
    """Runs `on_exit` (every rank leaves the process group together) in its `teardown` hook."""

    def __init__(self, on_exit: Callable[[], None]) -> None:
        self.on_exit = on_exit

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.on_exit()


class SpawnDDPStrategy(DDPStrategy):
    """DDPStrategy(start_method="spawn") whose workers run `on_exit` (leave the process group together) when a stage
    ends without an error.

    Lightning 2.6.6. Reason: Lightning's spawn worker returns with the process group still up; a worker that exits
    while its peer still holds gloo connections can abort ("terminate called without an active exception", seen at
    the end of a spawned test). `setup`, which runs in each worker, appends a `LeaveProcessGroup` to the Trainer's
    callbacks: the last one, so its `teardown` comes after every other callback's `on_fit_end` and `teardown` (the
    LightningModule's `teardown` and the loggers' `finalize` follow, then Lightning collects the worker's results;
    none of them needs the process group). On an error no teardown hook runs, and the group stays up, as Lightning
    leaves it. `on_exit` is a module-level function: spawn pickles it with the strategy into every worker.
    Tests: test_spawn_workers_leave_the_process_group_before_their_results_are_collected; and
    test_spawn_worker_leaves_the_process_group_up, which fails once Lightning leaves the group itself (then delete
    LeaveProcessGroup).
    """

    def __init__(self, *, on_exit: Callable[[], None], own_environment: bool = True, **kwargs: Any) -> None:
        """`own_environment`: meet on `PortPerLaunch`'s port (False where the Trainer gets a cluster environment as a
        plugin: Lightning takes one from either, not both)."""
        environment = PortPerLaunch() if own_environment else None
        super().__init__(start_method="spawn", cluster_environment=environment, **kwargs)
        self.on_exit = on_exit

    def setup(self, trainer: L.Trainer) -> None:
        super().setup(trainer)
        trainer.callbacks.append(LeaveProcessGroup(self.on_exit))


class PortPerLaunch(LightningEnvironment):
    """Lightning's environment for the processes its launcher starts, with the port the processes meet on checked at
    each launch.

    Lightning 2.6.6. Reason: Lightning chooses a free port once and keeps it in MASTER_PORT for every later launch of
    the process: a Trainer's `test` after its `fit`, a sweep's next trial. Between two launches nothing holds the
    port; another process may take it (a server, or a connection's own end), and the next launch fails in its
    rendezvous ("address already in use"). Here, in the process that launches, a port chosen for an earlier launch
    that is taken by now is replaced by a free one. A MASTER_PORT you set is yours, used as it is; the launched
    processes read the one their launch chose (Lightning sets it in their environment).
    Test: test_a_spawned_job_launches_again_on_a_free_port_when_its_port_was_taken.
    """

    def __init__(self) -> None:
        super().__init__()
        self._launcher_pid = os.getpid()

    @property
    def main_port(self) -> int:
        given = os.environ.get("MASTER_PORT")
        if os.getpid() != self._launcher_pid or (given is not None and int(given) not in CHOSEN):
            return super().main_port  # a launched process, or your port
        if given is not None and free(int(given)):
            return int(given)  # the port an earlier launch chose, still free
        port = find_free_network_port()
        CHOSEN.add(port)
        return port


def free(port: int) -> bool:
    """Whether a server could listen on `port` now (as torch's store does: with SO_REUSEADDR, so that the closed
    connections of an earlier launch do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True
