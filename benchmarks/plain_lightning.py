"""The job `python train.py` runs, as a bare Lightning script (no plan, samplers, metrics, checkpoints or logs):
the baseline for start-up time and speed in benchmarks/startup.py."""

import sys

import lightning as L
import torch
import torch.nn.functional as F

from first_step import FirstStepTimer
from myproject.data import DigitsDataModule
from myproject.models import DigitsCNN


class Plain(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = DigitsCNN()

    def training_step(self, b, i):
        return F.cross_entropy(self.net(b[0]), b[1])

    def test_step(self, b, i):
        self.log("acc", (self.net(b[0]).argmax(1) == b[1]).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)


dm = DigitsDataModule(global_batch_size=64)
dm.setup()
L.seed_everything(42)


def loader(split, shuffle):
    return torch.utils.data.DataLoader(dm.splits[split], batch_size=64, shuffle=shuffle)


trainer = L.Trainer(
    max_epochs=12, logger=False, enable_checkpointing=False, enable_progress_bar=False, callbacks=[FirstStepTimer()]
)
trainer.fit(Plain(), loader("train", True))
print(trainer.test(trainer.model, loader("test", False), verbose=False), file=sys.stderr)
