"""strategy.meta_init: a model built on the meta device, its construction recorded, replays to exactly the tensors
an ordinary build makes, in every style of initialisation a user writes; one that cannot be replayed is built
eagerly with a warning naming the tensor. (The 2-process runs of test_fsdp.py shard and train such models.)"""

import logging

import pytest
import torch
from lightning.pytorch.demos import Transformer
from torch import nn
from torch.nn.init import trunc_normal_

from scaleup.distributed.fsdp import build_recorded
from scaleup.distributed.meta_init import build_on_meta, materialize_outside, tensors_of
from testbed.models import ImageClassifier


class InitStyles(nn.Module):
    """The ways networks set their first weights: modules' own `reset_parameters`, an `nn.init` loop over
    `modules()`, tensors drawn with `torch.randn` and scaled, an orthogonal and a truncated-normal init (temporary
    tensors, QR, copies), torch.nn.init's other functions that skip meta tensors (sparse, Dirac; truncated normal
    imported by name), an embedding's zeroed padding row (a write into a view), tied weights, buffers computed from
    `arange` and `tril`, and one from data."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16, padding_idx=0)
        self.position = nn.Parameter(torch.randn(8, 16) * 0.02)
        self.blocks = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16))
        self.gate = nn.Linear(16, 16, bias=False)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("mask", torch.tril(torch.ones(8, 8)), persistent=False)
        self.register_buffer("frequencies", 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)))
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))
        for module in self.blocks.modules():
            if isinstance(module, nn.Linear):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                nn.init.trunc_normal_(module.bias, std=0.02)
        nn.init.orthogonal_(self.gate.weight)
        self.wide = nn.Parameter(torch.empty(4, 12))
        nn.init.orthogonal_(self.wide)  # fewer rows than columns: QR of the transpose
        self.sparse = nn.Linear(12, 6)
        nn.init.sparse_(self.sparse.weight, sparsity=0.5)
        self.conv = nn.Conv1d(4, 4, 3)
        nn.init.dirac_(self.conv.weight)
        trunc_normal_(self.conv.bias, std=0.5)


class TwoOutputs(nn.Module):
    """Sets two buffers with one call (`out=` of an operation with two results): no history of either can be
    replayed on its own."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("values", torch.empty(4))
        self.register_buffer("indices", torch.empty(4, dtype=torch.long))
        torch.sort(torch.rand(4), out=(self.values, self.indices))


def classifier(net: dict) -> ImageClassifier:
    return ImageClassifier(net=net, optimizer={"_target_": "torch.optim.SGD"})


BUILDS = {
    "init styles": InitStyles,
    "DigitsCNN with BatchNorm, float64": lambda: classifier(
        {"_target_": "testbed.models.DigitsCNN", "num_classes": 10, "norm": "batch"}
    ).double(),
    "ResNet-18": lambda: classifier({"_target_": "testbed.models.resnet", "name": "resnet18", "num_classes": 10}),
    "transformer (Lightning's demo)": lambda: Transformer(vocab_size=40, ninp=32, nhead=2, nhid=64, nlayers=1),
}


@pytest.mark.parametrize("build", BUILDS.values(), ids=BUILDS.keys())
def test_the_replayed_build_equals_the_ordinary_build_bit_for_bit(build):
    """Every parameter and buffer, and the random numbers drawn after the build (the generator ends where the
    ordinary build leaves it)."""
    torch.manual_seed(7)
    eager = build()
    after_eager = torch.rand(4)
    torch.manual_seed(7)
    meta, recording = build_on_meta(build)
    after_meta = torch.rand(4)
    assert torch.equal(after_eager, after_meta)
    assert all(t.is_meta for _, t in meta.named_parameters())
    assert recording.unreplayable(iter(tensors_of(meta))) is None
    expected, replayed = dict(tensors_of(eager)), dict(tensors_of(meta))
    assert expected.keys() == replayed.keys()
    for name, tensor in replayed.items():
        value = recording.value(tensor)
        assert value.dtype == expected[name].dtype and torch.equal(value, expected[name]), name


def test_the_lightning_modules_own_state_is_made_real_at_once():
    """Outside the networks (metrics, their states and defaults) nothing stays on the meta device: the metrics
    count as they would."""
    net = {"_target_": "testbed.models.DigitsCNN", "num_classes": 10}
    model, recording = build_on_meta(lambda: classifier(net))
    materialize_outside(model, [model.net], recording)
    metric = model.metrics.test_metrics["samples"]
    assert not any(t.is_meta for t in metric.metric_state.values())
    metric.update(torch.tensor(1.0))
    assert metric.compute().item() == 1.0
    metric.reset()  # back to its defaults, as at each epoch's start: real ones
    metric.update(torch.tensor(2.0))
    assert metric.compute().item() == 2.0
    assert model.net[0].weight.is_meta  # the networks wait for their shards


def test_an_init_that_cannot_be_replayed_is_built_whole_and_says_which_tensor(caplog):
    """The two buffers set by one call: the model is built as usual (the same tensors as an ordinary build, the same
    random numbers after it), and the warning names the tensor and the reason."""
    build = lambda: nn.ModuleDict({"net": TwoOutputs()})  # noqa: E731
    torch.manual_seed(3)
    eager = build()
    after_eager = torch.rand(2)
    torch.manual_seed(3)
    with caplog.at_level(logging.WARNING, logger="scaleup"):
        model, recording = build_recorded(build)
    assert recording is None and not any(t.is_meta for _, t in tensors_of(model))
    assert torch.equal(torch.rand(2), after_eager)
    for name, tensor in tensors_of(eager):
        assert torch.equal(dict(tensors_of(model))[name], tensor), name
    (warning,) = [r.getMessage() for r in caplog.records if "meta_init" in r.getMessage()]
    assert warning.startswith("strategy.meta_init: net.values cannot be made shard by shard (aten.sort.values: it")
