"""The step's seed: in-model randomness (dropout, stochastic depth, noise) drawn from (seed, optimizer step, the
micro-batch's offset in the global batch), whatever the topology (scaleup.data.seeding says why). StepPlan, in
callbacks/step_plan.py, calls it."""

from __future__ import annotations

import lightning as L
import torch

from scaleup.data.seeding import MODEL, micro_batch_offset, mixed_seed, seed_host_generators
from scaleup.plan.batch import resolve_batch


class StepSeed:
    """Before each training micro-batch, seeds the generators from (seed, optimizer step, the micro-batch's
    offset in the global batch), so dropout and other in-model randomness draw the same numbers for the same
    samples at the same step, whatever the split over devices and accumulation, and after a resume.

    Replaces one seed per rank at the start of training, which made masks depend on the rank and a resumed run
    draw a fresh stream. `seed_everything(seed)` before the model is built still gives every rank the same
    initial weights.
    """

    def __init__(self, seed: int, global_batch_size: int) -> None:
        self.seed, self.global_batch_size = seed, global_batch_size
        self._step: int | None = None
        self._micro_batch = 0
        self._stream = mixed_seed(seed, MODEL)  # the keys every step shares, mixed once
        self._rank_offset = self._per_device = 0
        self._gpu_generator: torch.Generator | None = None

    def attach(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """At the start of training. The topology is fixed for the fit (and settled by now, also by AutoBatchSize):
        read from the Trainer's properties once, not at every step."""
        batch = resolve_batch(self.global_batch_size, None, trainer.world_size, trainer.accumulate_grad_batches)
        self._per_device = batch.per_device
        self._rank_offset = micro_batch_offset(trainer.global_rank, batch.accumulation, 0, batch.per_device)
        # The process's GPU generator itself: `torch.cuda.manual_seed` looks it up through a lazy-init queue.
        device = pl_module.device
        if device.type == "cuda":
            index = torch.cuda.current_device() if device.index is None else device.index
            self._gpu_generator = torch.cuda.default_generators[index]

    def seed_for(self, step: int) -> None:
        """Before a training micro-batch of optimizer step `step` (the plan's steps done)."""
        # Counted from the plan's step (the optimizer step; the global batch under manual optimization) rather than
        # from batch_idx: a checkpoint always falls between two steps, so after a resume the first micro-batch is a
        # step's first, whatever Lightning's batch counters say.
        self._micro_batch = self._micro_batch + 1 if step == self._step else 0
        self._step = step
        offset = self._rank_offset + self._micro_batch * self._per_device  # micro_batch_offset
        seed = mixed_seed(step, offset, start=self._stream)
        seed_host_generators(seed)
        if self._gpu_generator is not None:
            self._gpu_generator.manual_seed(seed)
