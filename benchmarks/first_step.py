"""A callback that prints the wall-clock time of the first optimizer step (for the benchmarks here)."""

import time

import lightning as L


class FirstStepTimer(L.Callback):
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 1 and trainer.is_global_zero:
            print(f"FIRST_STEP_AT {time.time():.3f}", flush=True)
