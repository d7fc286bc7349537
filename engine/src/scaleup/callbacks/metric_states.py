"""Every process gets its own torchmetrics states, whatever started it."""

import lightning as L
from torchmetrics import Metric


class PrivateMetricStates(L.Callback):
    """Resets every torchmetrics Metric in the module when a stage is set up, in each process.

    ddp_spawn hands the module to its processes through shared memory, so on CPU every rank's metric states would
    be one shared tensor (each rank adding into the others' sums). A reset gives each process fresh tensors of its
    own. This covers any metric in any user module, not only those of StageMetrics.
    """

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for module in pl_module.modules():
            if isinstance(module, Metric):
                module.reset()
