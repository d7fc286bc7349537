"""A user's own code, as the contract allows it: used with `model._target_=user_modules.<Name>` in real runs."""

import contextlib
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import lightning as L
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from pydantic import Field
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from scaleup.observability.metrics import StageMetrics
from testbed.data import DigitsDataModule
from testbed.models import DigitsCNN, ImageClassifier, Norm


class TwoGroupClassifier(ImageClassifier):
    """The head at the configured LR, the body below it at a tenth: the ratio must hold at every step."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        head = list(self.net[-1].parameters())
        body = [p for p in self.net.parameters() if all(p is not q for q in head)]
        lr = self.hparams.optimizer["lr"]
        return torch.optim.SGD([{"params": body, "lr": 0.1 * lr, "name": "body"}, {"params": head, "name": "head"}], lr)


class CountingClassifier(ImageClassifier):
    """Counts its `configure_optimizers` calls (class-wide: the engine builds the module itself)."""

    calls = 0

    def configure_optimizers(self) -> Any:
        CountingClassifier.calls += 1
        return super().configure_optimizers()


# What the template says to a module that returns a scheduler.
SCHEDULER_REFUSED = (
    "SchedulerClassifier.configure_optimizers returns a learning-rate scheduler (StepLR), which would fight the "
    "template's own schedule: return only the optimizer and set lr_schedule.rule, warmup_epochs (or "
    "warmup_steps), decay=cosine|step|none, milestones and gamma instead"
)


class SchedulerClassifier(ImageClassifier):
    """Returns its own LR scheduler, which the template refuses."""

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = super().configure_optimizers()
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)}


class EncoderModule(L.LightningModule):
    """Not the template's classifier: its network is `self.encoder`, built from the `encoder` config."""

    def __init__(self, encoder: Mapping[str, Any], optimizer: Mapping[str, Any]) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = instantiate(dict(encoder))
        self.metrics = StageMetrics({"acc": MulticlassAccuracy(encoder["num_classes"], average="micro")})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)

    def _step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.metrics.update(stage, logits, y, batch_size=len(y), loss=loss)
        self.metrics.log(self, stage)
        return loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return instantiate(dict(self.hparams.optimizer), _partial_=True)(self.parameters())


class StreamLoaderDataModule(L.LightningDataModule):
    """A plain LightningDataModule whose loaders read a stream (an IterableDataset)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(StreamedDigits(), batch_size=16)


class RangedCNN(DigitsCNN):
    """The suite's CNN with ranges on its arguments (`Annotated[..., Field(...)]`, optional to a user's code): the
    config's values are checked against them before anything is built."""

    def __init__(
        self,
        num_classes: Annotated[int, Field(ge=1)] = 10,
        in_channels: Annotated[int, Field(ge=1)] = 1,
        width: Annotated[int, Field(ge=1)] = 32,
        norm: Norm = "batch",
        dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0,
    ) -> None:
        super().__init__(num_classes, in_channels, width, norm, dropout)


class BuggyClassifier(ImageClassifier):
    """A bug in the user's own __init__: a TypeError raised by torch inside it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.buffer = torch.empty(None)  # the bug


class HardCodedPathClassifier(ImageClassifier):
    """A bug in the user's own __init__: a file opened at a path written in the code, not given in the config."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        with open("/nonexistent/class_names.txt") as names:  # the missing file
            self.class_names = names.read().split()


class CallbackCensus(L.Callback):
    """Writes the classes of the Trainer's callbacks, in their order, to `path` (JSON) when fit starts."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        names = [f"{type(cb).__module__}.{type(cb).__qualname__}" for cb in trainer.callbacks]
        with open(self.path, "w") as f:
            json.dump(names, f)


class StreamedDigits(torch.utils.data.IterableDataset):
    """A stream of samples: no `__len__`, no `__getitem__`, nothing a sampler can split between ranks."""

    def __iter__(self):
        yield from ((torch.zeros(1, 8, 8), 0) for _ in range(64))


class StreamingDataModule(DigitsDataModule):
    """The suite's digits, with a training split that is a stream (an IterableDataset)."""

    def build_splits(self) -> dict[str, torch.utils.data.Dataset]:
        return {**super().build_splits(), "train": StreamedDigits()}


class LitAutoEncoder(L.LightningModule):
    """Lightning's README module, adapted to digits (8x8 images, 64 inputs), with validation and test steps: every
    metric is a plain `self.log(name, tensor)`, no sync_dist, no torchmetrics (model=lit_autoencoder, tests/configs)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 3))
        self.decoder = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, _ = batch
        x = x.view(x.size(0), -1)
        return F.mse_loss(self.decoder(self.encoder(x)), x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class ReductionLogger(L.Callback):
    """Logs, from the eval batch hooks, a metric for each reduction Lightning offers, each the same whatever the
    batches (a sample count, the largest and smallest per-sample pixel sum, a batch-size-weighted mean pixel, and the
    same mean with `sync_dist=True`, as many users write it); and, at the validation epoch's end, each rank's own
    rank, which no reduction can make exact, with and without `sync_dist=True`, and a value the same on every rank
    (exact either way)."""

    def _log(self, pl_module: L.LightningModule, stage: str, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x = batch[0].flatten(1)
        pl_module.log(f"{stage}_samples", float(len(x)), reduce_fx="sum")
        pl_module.log(f"{stage}_max_sum", x.sum(1).max(), reduce_fx="max")
        pl_module.log(f"{stage}_min_sum", x.sum(1).min(), reduce_fx="min")
        pl_module.log(f"{stage}_mean_pixel", x.mean(), batch_size=len(x))
        pl_module.log(f"{stage}_synced_pixel", x.mean(), sync_dist=True)

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, *args) -> None:
        self._log(pl_module, "val", batch)

    def on_test_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, *args) -> None:
        self._log(pl_module, "test", batch)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.log("val_rank", float(trainer.global_rank))
        pl_module.log("val_synced_rank", float(trainer.global_rank), sync_dist=True)
        pl_module.log("val_same", 1.0)
        pl_module.log("val_synced_same", 1.0, sync_dist=True)


class DictSamples(torch.utils.data.Dataset):
    """A split whose samples are dicts (Hugging Face's convention): `{"image": ..., "label": ...}`."""

    def __init__(self, samples: torch.utils.data.Dataset) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        image, label = self.samples[index]
        return {"image": image, "label": label}


class DictDigitsDataModule(DigitsDataModule):
    """The suite's digits, each sample a dict: batches are dicts of tensors."""

    def build_splits(self) -> dict[str, torch.utils.data.Dataset]:
        return {name: DictSamples(split) for name, split in super().build_splits().items()}


class TwoOptimizerGAN(L.LightningModule):
    """A GAN's shape with manual optimization, as a new user writes one: a generator (a digit's class, one-hot, to
    its 64 pixels) and a discriminator (64 pixels to a real-or-generated logit), one Linear layer each, each with its
    own optimizer, each stepped once per batch. No noise: the generated image is a function of the class, so 1 and
    2 processes can end with the same weights. The discriminator's LR is `discriminator_lr` times the configured
    one, both in unnamed param groups. val/acc: how often the discriminator tells real from generated.

    The discriminator's loss leaves the generator without gradients: on 2 processes DDP needs
    strategy.find_unused_parameters=true. The generator's loss reaches every parameter (through the discriminator),
    and torch then warns that DDP found no unused parameters; with `toggle=True` each optimizer's part of the step runs
    in `self.toggled_optimizer(...)`, as Lightning's docs write a GAN, and each backward reaches that optimizer's
    parameters alone: the same weights, no warning."""

    def __init__(self, optimizer: Mapping[str, Any], discriminator_lr: float = 0.5, toggle: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = nn.Linear(10, 64)
        self.discriminator = nn.Linear(64, 1)

    def generate(self, labels: torch.Tensor) -> torch.Tensor:
        return self.generator(F.one_hot(labels, 10).to(self.generator.weight.dtype))

    def only(self, optimizer: Any) -> contextlib.AbstractContextManager:
        """`self.toggled_optimizer(optimizer)` with `toggle=True`, else nothing."""
        return self.toggled_optimizer(optimizer) if self.hparams.toggle else contextlib.nullcontext()

    def judge(self, images: torch.Tensor, real: bool) -> torch.Tensor:
        """The discriminator's loss on `images` (a mean over the device's batch) for the label `real`."""
        logits = self.discriminator(images).squeeze(1)
        return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, float(real)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        generator_optimizer, discriminator_optimizer = self.optimizers()
        fake = self.generate(labels)
        with self.only(discriminator_optimizer):
            discriminator_loss = self.judge(images.flatten(1), True) + self.judge(fake.detach(), False)
            discriminator_optimizer.zero_grad()
            self.manual_backward(discriminator_loss)
            discriminator_optimizer.step()
        with self.only(generator_optimizer):
            generator_loss = self.judge(fake, True)
            generator_optimizer.zero_grad()
            self.manual_backward(generator_loss)
            generator_optimizer.step()
        self.log_dict({"train/d_loss": discriminator_loss, "train/g_loss": generator_loss})

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> None:
        images, labels = batch
        real = self.discriminator(images.flatten(1)) > 0
        generated = self.discriminator(self.generate(labels)) < 0
        accuracy = torch.cat([real, generated]).to(images.dtype).mean()
        self.log(f"{stage}/acc", accuracy, batch_size=2 * len(labels))

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        settings = dict(self.hparams.optimizer)
        build = instantiate(settings, _partial_=True)
        discriminator_lr = settings["lr"] * self.hparams.discriminator_lr
        return [build(self.generator.parameters()), build(self.discriminator.parameters(), lr=discriminator_lr)]


class MisbehavingClassifier(ImageClassifier):
    """The suite's classifier, whose training_step misbehaves on one rank at one optimizer step, as the environment
    says (engine/tests/test_rank_failures.py): MISBEHAVE=hang (sleeps for ever), raise, or wait_for_kill (sleeps until
    the test kills it), on rank MISBEHAVE_RANK at step MISBEHAVE_STEP; hang_on_fit_start (that rank sleeps for ever in
    on_fit_start); slow (every rank sleeps MISBEHAVE_SECONDS at step MISBEHAVE_STEP, then goes on). Every rank
    writes its pid to MISBEHAVE_DIR/rank<N>.pid as fit starts; the misbehaving rank writes MISBEHAVE_DIR/reached
    when it gets there. Without MISBEHAVE it trains as ImageClassifier does (a resume of the same run)."""

    def on_fit_start(self) -> None:
        if os.environ.get("MISBEHAVE"):
            Path(os.environ["MISBEHAVE_DIR"], f"rank{self.global_rank}.pid").write_text(str(os.getpid()))
        if os.environ.get("MISBEHAVE") == "hang_on_fit_start" and self.global_rank == misbehaving_rank():
            Path(os.environ["MISBEHAVE_DIR"], "reached").touch()
            time.sleep(10**6)  # on_fit_start's hang

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        what, step = os.environ.get("MISBEHAVE"), int(os.environ.get("MISBEHAVE_STEP", -1))
        this_rank = what in ("hang", "raise", "wait_for_kill") and self.global_rank == misbehaving_rank()
        if self.global_step == step and (what == "slow" or this_rank):
            Path(os.environ["MISBEHAVE_DIR"], "reached").touch()
            if what == "slow":  # every rank at once: slow, not hung
                time.sleep(float(os.environ["MISBEHAVE_SECONDS"]))
            elif what == "raise":
                raise ValueError(f"rank {self.global_rank} cannot go on at step {self.global_step}")
            else:
                time.sleep(10**6)  # hang, or wait_for_kill: the test kills this process here
        return super().training_step(batch, batch_idx)


def misbehaving_rank() -> int:
    return int(os.environ.get("MISBEHAVE_RANK", -1))


class BlockingSamples(torch.utils.data.Dataset):
    """A split whose `__getitem__` blocks for ever in a process that read `after` samples of it (each DataLoader
    worker counts its own), writing that process's pid to MISBEHAVE_DIR/worker<pid>.pid and the `reached` mark."""

    def __init__(self, samples: torch.utils.data.Dataset, after: int) -> None:
        self.samples, self.after, self.read = samples, after, 0

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Any:
        self.read += 1
        if self.read > self.after:
            Path(os.environ["MISBEHAVE_DIR"], f"worker{os.getpid()}.pid").write_text(str(os.getpid()))
            Path(os.environ["MISBEHAVE_DIR"], "reached").touch()
            time.sleep(10**6)  # a loader worker's hang
        return self.samples[index]


class MisbehavingDigits(DigitsDataModule):
    """The suite's digits, whose training split blocks on rank MISBEHAVE_RANK after MISBEHAVE_STEP samples (per
    loader process) where MISBEHAVE=hang_in_data, or whose set-up blocks there where MISBEHAVE=hang_in_setup
    (engine/tests/test_rank_failures.py). The rank is the launcher's LOCAL_RANK (one node)."""

    def build_splits(self) -> dict[str, torch.utils.data.Dataset]:
        splits = super().build_splits()
        rank = int(os.environ.get("LOCAL_RANK", 0))
        if os.environ.get("MISBEHAVE") == "hang_in_setup" and rank == misbehaving_rank():
            Path(os.environ["MISBEHAVE_DIR"], f"rank{rank}.pid").write_text(str(os.getpid()))
            Path(os.environ["MISBEHAVE_DIR"], "reached").touch()
            time.sleep(10**6)  # a set-up's hang
        if os.environ.get("MISBEHAVE") == "hang_in_data" and rank == misbehaving_rank():
            splits["train"] = BlockingSamples(splits["train"], int(os.environ["MISBEHAVE_STEP"]))
        return splits
