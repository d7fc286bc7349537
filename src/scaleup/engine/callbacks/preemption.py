"""Save and stop cleanly when the scheduler asks the job to go (SIGTERM; SIGUSR1 under SLURM)."""

import logging
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)


class PreemptionCheckpoint(L.Callback):
    """On SIGTERM, Lightning finishes the current batch on every rank and raises SIGTERMException; this writes
    `last.ckpt` at that step so `ckpt_path=last` continues from it. (Under SLURM, Lightning's own SIGUSR1
    handler saves an `hpc_ckpt` and requeues the job.)"""

    def __init__(self, dirpath: str | Path) -> None:
        self.path = f"{str(dirpath).rstrip('/')}/last.ckpt"  # a local path or a URL

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException) and trainer.state.fn == "fit":
            trainer.save_checkpoint(self.path)  # rank 0 writes, every rank waits at the barrier
            if trainer.is_global_zero:
                log.warning(f"stopped by SIGTERM at step {trainer.global_step}; saved {self.path}")
