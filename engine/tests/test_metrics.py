"""The template's own metrics hold each step's addends on the host (HeldSum): fewer tensor ops per training step, the
same values for every reader."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from scaleup.observability.metrics import FOLD_EVERY, SampleMean, SampleSum, StageMetrics, TopKAccuracy


class TensorOps(TorchDispatchMode):
    """Records the name of every aten op that runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_a_training_step_update_makes_only_the_ops_that_compute_what_it_adds():
    """Top-1 accuracy, the loss and the sample count: an argmax, a comparison and the loss's detach per step, and
    every FOLD_EVERY steps one concatenation, sum and add per state."""
    metrics = StageMetrics({"acc": TopKAccuracy(k=1)})
    logits, target = torch.randn(16, 10, requires_grad=True), torch.randint(0, 10, (16,))
    loss = torch.nn.functional.cross_entropy(logits, target)
    with TensorOps() as counted:
        metrics.update("train", logits, target, batch_size=16, loss=loss)
    assert counted.ops == ["argmax.default", "eq.Tensor", "detach.default"]
    with TensorOps() as counted:
        for _ in range(FOLD_EVERY - 1):
            metrics.update("train", logits, target, batch_size=16, loss=loss)
    assert len(counted.ops) == 3 * (FOLD_EVERY - 1) + 2 * 3  # the two held tensor sums fold: cat, sum, add_ each
    _, _, loss_mean, samples = metrics._stage("train")
    assert (samples.update_count, loss_mean._held_samples.number) == (FOLD_EVERY, 16 * FOLD_EVERY)  # counts wait


def test_every_reader_sees_what_is_held():
    """compute, the states torchmetrics reads (metric_state, a dtype change through `_apply`), a deep copy and
    forward all count the held addends; reset and setting a state (what loading one does) drop them."""
    losses = [torch.tensor(float(i)) for i in range(FOLD_EVERY + 5)]
    weights = [16 if i % 3 else 8 for i in range(len(losses))]  # a short batch now and then
    expected = sum(float(x) * w for x, w in zip(losses, weights, strict=True)) / sum(weights)
    mean = SampleMean()
    for x, w in zip(losses, weights, strict=True):
        mean.update(x, w)
    assert mean._held_total.count == 5  # folded once, 5 held
    assert copy.deepcopy(mean).compute().item() == pytest.approx(expected)
    assert mean.metric_state["samples"].item() == sum(weights)
    mean.update(torch.tensor(1.0), 4)
    mean.set_dtype(torch.float64)  # `_apply` reads each state, folds, and replaces it
    assert mean.total.dtype == torch.float64 and mean._held_total.count == 0
    assert mean.compute().item() == pytest.approx((expected * sum(weights) + 4) / (sum(weights) + 4))

    total = SampleSum()
    total.update(2.0)
    assert total(torch.tensor(3.0)).item() == 3.0 and total.compute().item() == 5.0  # forward: this batch, and all
    total.update(7.0)
    total.reset()
    total.update(0.5)
    assert total.compute().item() == 0.5
    total.update(7.0)
    total.total = torch.tensor(1.0)
    assert total.compute().item() == 1.0


def test_held_accuracy_counts_every_sample_through_folds():
    torch.manual_seed(0)
    logits, target = torch.randn(FOLD_EVERY * 3 + 7, 10), torch.randint(0, 10, (FOLD_EVERY * 3 + 7,))
    accuracy = {k: TopKAccuracy(k) for k in (1, 5)}
    with torch.inference_mode():  # as in validation: held inference tensors fold outside it
        for start in range(0, len(target), 3):
            for metric in accuracy.values():
                metric.update(logits[start : start + 3], target[start : start + 3])
    for k, metric in accuracy.items():
        hits = (logits.topk(k).indices == target.unsqueeze(1)).any(1)
        assert (metric.correct.item(), metric.total.item()) == (hits.sum().item(), len(target))
