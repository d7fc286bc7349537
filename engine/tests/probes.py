"""Test-only callbacks, added to real runs with `+callbacks.probe._target_=probes.RankProbe`.

They record what each rank actually saw, so tests can check rank-level guarantees from outside.
"""

import json
import os
import signal
from pathlib import Path

import lightning as L
import torch
from torch import nn

from testbed.data import DigitsDataModule
from testbed.models import ImageClassifier


@torch.no_grad()
def parameter_checksum(net: nn.Module) -> float:
    """A cheap fingerprint of all weights, to compare models across ranks or runs."""
    return float(
        sum(p.double().sum() + p.double().abs().sum() for p in net.state_dict().values() if p.is_floating_point())
    )


class RankProbe(L.Callback):
    """Writes rank<r>.json: initial weights checksum, the sample indices of each epoch, and for each micro-batch of
    the first `draw_steps` optimizer steps its step, a checksum of its (augmented) inputs and a draw from the
    stream dropout draws from."""

    def __init__(self, out_dir: str, draw_steps: int = 2) -> None:
        self.out_dir = Path(out_dir)
        self.draw_steps = draw_steps
        self.record: dict = {"epochs": {}, "micro_batches": []}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Before DDP wraps the model (and broadcasts rank 0's weights): what this rank built by itself. (A model
        # built on the meta device for strategy=fsdp has no values before the strategy shards it.)
        if not any(p.is_meta for p in pl_module.net.parameters()):
            self.record["initial_checksum"] = parameter_checksum(pl_module.net)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.record["rank"] = trainer.global_rank
        self.record["local_rank"] = trainer.local_rank
        self.record["node_rank"] = trainer.node_rank
        self.record["world_size"] = trainer.world_size

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_step >= self.draw_steps:
            return
        with torch.random.fork_rng(devices=[]):  # after StepSeed, and leaving the model's stream as it found it
            draw = torch.rand(8, dtype=torch.float64).tolist()
        inputs = float(batch[0].double().sum())
        self.record["micro_batches"].append({"step": trainer.global_step, "draw": draw, "inputs": inputs})

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        sampler = trainer.train_dataloader.sampler  # the sampler this rank's loader iterates, after set_epoch
        # (epoch, index) pairs where the split is seeded per sample, plain indices where it draws nothing random
        keys = list(sampler)
        self.record["epochs"][str(trainer.current_epoch)] = [key[1] if isinstance(key, tuple) else key for key in keys]

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.record))
        (self.out_dir / f"pid{trainer.global_rank}").write_text(str(os.getpid()))


class LRProbe(L.Callback):
    """Writes `path` (JSON): for each training batch, by its index over all epochs, the LR of every param group of
    every optimizer as the batch's steps used it."""

    def __init__(self, path: str) -> None:
        self.path, self.lrs = Path(path), {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int):
        groups = [[group["lr"] for group in optimizer.param_groups] for optimizer in trainer.optimizers]
        self.lrs[trainer.fit_loop.epoch_loop.total_batch_idx] = groups

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            self.path.write_text(json.dumps(self.lrs))


class StopAfterEpochs(L.Callback):
    """Ends fit after `epochs` epochs while the plan still counts the full run: an interruption, cleanly."""

    def __init__(self, epochs: int) -> None:
        self.epochs = epochs

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch + 1 >= self.epochs:
            trainer.should_stop = True


class CallbackNames(L.Callback):
    """Writes the class names of the Trainer's callbacks, in order, to `out` when fit starts."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.out.write_text(json.dumps([type(callback).__name__ for callback in trainer.callbacks]))


class FailOnRank(L.Callback):
    """Raises on one rank at one step, as a bug or a dying GPU would; with `first_attempt_only`, only before
    torchrun's first restart; with `job`, only in that sweep job (a search's trial `job`)."""

    def __init__(self, rank: int, step: int, first_attempt_only: bool = False, job: int | None = None) -> None:
        self.rank, self.step, self.first_attempt_only, self.job = rank, step, first_attempt_only, job

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        from hydra.core.hydra_config import HydraConfig

        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
        if (
            trainer.global_rank == self.rank
            and trainer.global_step == self.step
            and not (self.first_attempt_only and restarted)
            and (self.job is None or HydraConfig.get().job.num == self.job)
        ):
            raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step}")


class GlobalCountLoss(ImageClassifier):
    """The seeds' pitfall: per-sample losses summed and divided by the global batch size. Right on 1 device,
    scaled down by the number of devices under DDP (whose gradient averaging already divides by it)."""

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        global_batch = self.trainer.world_size * self.trainer.accumulate_grad_batches * target.numel()
        return torch.nn.functional.cross_entropy(logits, target, reduction="sum") / global_batch


class MemoryHog(L.Callback):
    """Holds 1 GB on one rank only: the asymmetry TrainingDiagnostics should report."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == self.rank:
            self.hoard = torch.ones(2**28)  # 1 GiB of float32, written so it is resident


class SimulatedMemoryLimit(L.Callback):
    """A device that holds at most `max_batch[rank]` samples: the auto batch probe's forward pass raises
    OutOfMemoryError above it, as CUDA would. Only the limit is simulated; the probe and training run for real."""

    def __init__(self, max_batch: list[int]) -> None:
        self.max_batch = list(max_batch)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from scaleup.plan.batch_probe import AutoBatchSize

        probe = next(cb for cb in trainer.callbacks if isinstance(cb, AutoBatchSize))
        probe.forward = limited(probe.forward, self.max_batch[trainer.global_rank])


def limited(forward, max_batch: int):
    """`forward(module, batch)` that runs out of memory above `max_batch` samples."""

    def forward_with_limit(module, batch):
        if len(batch[0]) > max_batch:
            raise torch.OutOfMemoryError(f"simulated: {len(batch[0])} samples > {max_batch}")
        return forward(module, batch)

    return forward_with_limit


class SigtermAtBatch(L.Callback):
    """Sends this process SIGTERM after training batch `batch_idx` of epoch `epoch`, as a scheduler would:
    a pre-emption at a chosen micro-batch, e.g. between the micro-batches of one accumulated step."""

    def __init__(self, epoch: int, batch_idx: int) -> None:
        self.epoch, self.batch_idx = epoch, batch_idx

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int):
        if (trainer.current_epoch, batch_idx) == (self.epoch, self.batch_idx):
            os.kill(os.getpid(), signal.SIGTERM)


class SigtermParentAtStep(L.Callback):
    """Rank 0 sends its parent process SIGTERM at the end of step `step`: under torchrun, the agent, as a scheduler
    signals the process it started."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int):
        if trainer.global_rank == 0 and trainer.global_step == self.step:
            os.kill(os.getppid(), signal.SIGTERM)


class SigtermAfterFit(L.Callback):
    """Sends SIGTERM to rank `rank` when fit has ended, before the test starts: a pre-emption between the stages."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGTERM)


class CtrlCAtBatch(L.Callback):
    """Ctrl-C after training batch `batch_idx` of epoch 0: SIGINT to this process, as a terminal sends it, `presses`
    times in a row."""

    def __init__(self, batch_idx: int, presses: int = 1) -> None:
        self.batch_idx, self.presses = batch_idx, presses

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int):
        if batch_idx == self.batch_idx and trainer.current_epoch == 0:
            for _ in range(self.presses):
                os.kill(os.getpid(), signal.SIGINT)


class NanWeightsAtStep(L.Callback):
    """Sets the network's first parameter to NaN as optimizer step `step` starts, on rank `rank` (every rank: None):
    weights that blew up, so that the loss is NaN from that step on."""

    stopped_at: int | None = None  # the global step of the last run's error, in this process

    def __init__(self, step: int, rank: int | None = None) -> None:
        self.step, self.rank = step, rank
        NanWeightsAtStep.stopped_at = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            with torch.no_grad():
                next(pl_module.parameters()).fill_(float("nan"))

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        NanWeightsAtStep.stopped_at = trainer.global_step


class SigtermOnLoad(torch.utils.data.Dataset):
    """A split whose loading of sample `index` sends this process SIGTERM, once (the marker file remembers):
    a pre-emption at a known point of whichever phase reads that split, in whichever rank loads the sample."""

    def __init__(self, data: torch.utils.data.Dataset, index: int, marker: str) -> None:
        self.data, self.index, self.marker = data, index, Path(marker)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        if i == self.index and not self.marker.exists():
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGTERM)
        return self.data[i]


class SigtermDigits(DigitsDataModule):
    """Digits whose `split` sends SIGTERM when its sample `index` is loaded (with `data.num_workers=0`, in the
    training process): `data._target_=probes.SigtermDigits +data.split=test +data.index=0 +data.marker=PATH`."""

    def __init__(self, split: str, index: int, marker: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.split, self.index, self.marker = split, index, marker

    def build_splits(self):
        splits = super().build_splits()
        splits[self.split] = SigtermOnLoad(splits[self.split], self.index, self.marker)
        return splits


class OwnGeneratorNoise(ImageClassifier):
    """Scales its loss by noise from a generator of its own: seeded once per process (as `torch.Generator()` and
    `np.random.default_rng()` in user code are), so its numbers depend on the process, not on the samples."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.noise = torch.Generator().manual_seed(int(os.environ.get("RANK", 0)))

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        scale = 1 + 0.1 * torch.rand((), generator=self.noise)
        return torch.nn.functional.cross_entropy(logits, target) * scale.to(logits.dtype)


class LazyGeneratorNoise(ImageClassifier):
    """OwnGeneratorNoise's generator made on the first training step and kept as an attribute: absent when
    training starts."""

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        if not hasattr(self, "noise"):
            self.noise = torch.Generator().manual_seed(self.global_rank)
        return super().training_step(batch, batch_idx) * (1 + 0.1 * torch.rand((), generator=self.noise).item())


class StepGeneratorNoise(ImageClassifier):
    """OwnGeneratorNoise's generator made in every training step, seeded by the rank, in a local variable: no
    attribute of the module holds it."""

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        noise = torch.Generator().manual_seed(self.global_rank)
        return super().training_step(batch, batch_idx) * (1 + 0.1 * torch.rand((), generator=noise).item())


class FunctionalDropout(ImageClassifier):
    """Dropout on the logits through `F.dropout`, not a dropout layer: drawn from torch's global generator by
    position (the same on any topology), but a mask for a whole batch is not two masks for its halves."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(self.net(x), 0.1, self.training)


class KillJobOnce(L.Callback):
    """SIGKILLs this process at optimizer step `step` of sweep job `job` (a search's trial `job`), once: the marker
    file remembers, so that the same command, run again, goes through. A crash no handler sees (kill -9, OOM)."""

    def __init__(self, job: int, step: int, marker: str) -> None:
        self.job, self.step, self.marker = job, step, Path(marker)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int):
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.get().job.num == self.job and trainer.global_step == self.step and not self.marker.exists():
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)


class StartWeights(L.Callback):
    """Writes the whole model's state_dict as training starts (after the strategy set it up: for strategy=fsdp each
    tensor gathered whole from the shards), each rank its own: `out_dir`/start<rank>.pt."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch.distributed.tensor import DTensor

        state = {
            name: (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()
            for name, tensor in pl_module.state_dict().items()
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(state, self.out_dir / f"start{trainer.global_rank}.pt")


class CountedBuilds(ImageClassifier):
    """The classifier, writing `<builds>/<pid>-<n>` each time a process builds it: how often a run builds its module."""

    def __init__(self, builds: str, **kwargs) -> None:
        super().__init__(**kwargs)
        Path(builds).mkdir(parents=True, exist_ok=True)
        count = len(list(Path(builds).glob(f"{os.getpid()}-*")))
        (Path(builds) / f"{os.getpid()}-{count}").touch()
