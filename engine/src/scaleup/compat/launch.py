"""Starting and stopping processes the way Lightning's launchers do not: spawn workers that leave the process group
together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy


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

    def __init__(self, *, on_exit: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(start_method="spawn", **kwargs)
        self.on_exit = on_exit

    def setup(self, trainer: L.Trainer) -> None:
        super().setup(trainer)
        trainer.callbacks.append(LeaveProcessGroup(self.on_exit))
