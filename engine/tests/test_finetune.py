"""A run that starts from weights (`init.weights`, scaleup/finetune.py): every kind of file a user has loads the same
tensors, what the file does not fill is named (allowed only where init.skip says so), and 1 process, 2 DDP processes
and 2 FSDP processes built on the meta device start from the same weights and train to the same ones in float64,
frozen parameters untouched. A fine-tuned run evaluates, exports and resumes like any other.

One source run (1 epoch of digits, exported) serves every test; the fine-tuning recipe runs once on 1 process (in this
process) and once each on 2 DDP and 2 FSDP processes.
"""

import argparse
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torchvision
from hydra.utils import instantiate
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from conftest import (
    QUICK,
    TOLERANCE,
    assert_same_weights,
    check,
    engine_section,
    in_process,
    made_once,
    read_json,
    run,
)
from scaleup.checkpoints.io import load_checkpoint
from scaleup.checkpoints.weights_file import open_weights
from scaleup.errors import UserError
from scaleup.finetune import NOT_HERE, load, match, prepare_start
from testbed.models import ImageClassifier

DIGITS_NET = {"_target_": "testbed.models.DigitsCNN", "num_classes": 10, "in_channels": 1}
# The fine-tuning recipe: a new head (net.13, as built), the first two conv blocks frozen, BatchNorm in eval mode
# (its statistics do not depend on how the global batch is split, so every topology trains to the same weights).
FROZEN = ["0.weight", "1.weight", "1.bias", "3.weight", "4.weight", "4.bias"]
RECIPE = [
    *QUICK,
    "trainer.max_epochs=1",
    "logger=none",  # nothing here reads TensorBoard (and without it no test-time figures are drawn)
    "trainer.precision=64-true",
    "model.optimizer.lr=0.02",
    "init.skip=[13]",
    "init.freeze=[0,1,3,4]",
    "init.freeze_bn=true",
    "+callbacks.start._target_=probes.StartWeights",
    "+callbacks.start.out_dir=${hydra:runtime.output_dir}/start",
]


def fresh(net: dict = DIGITS_NET) -> ImageClassifier:
    torch.manual_seed(0)
    return ImageClassifier(net=net, optimizer={"_target_": "torch.optim.SGD", "lr": 0.1})


def settings(**init):
    return engine_section("init/default", **init)


def loaded_net(weights, **init) -> dict[str, torch.Tensor]:
    """A freshly built model's `net` after loading `weights` as train.py does, its state_dict."""
    model, config = fresh(), settings(weights=str(weights), **init)
    file = open_weights(config.weights)
    load(model, config.module, match(file, model.get_submodule(config.module), config), file, None)
    return model.net.state_dict()


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """One epoch of digits (float32, BatchNorm) and its export, net.pt."""

    def make(run_dir: Path) -> None:
        in_process([*QUICK, "trainer.max_epochs=1", "logger=none", f"hydra.run.dir={run_dir}"])
        in_process([f"ckpt_path={run_dir}", f"output_path={run_dir / 'net.pt'}"], job="export")

    return made_once(tmp_path_factory, "finetune-source", make)


@pytest.fixture(scope="module")
def tuned(source, tmp_path_factory) -> Path:
    """The fine-tuning recipe from the source's export, on 1 process."""
    run_dir = tmp_path_factory.mktemp("tuned") / "run"
    in_process([*RECIPE, f"init.weights={source / 'net.pt'}", f"hydra.run.dir={run_dir}"])
    return run_dir


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save on one process, as meant
def test_every_kind_of_weights_file_loads_the_same_weights(source, tmp_path):
    """The export, a plain state_dict in torch's old file format, this template's checkpoint (`net.` keys; by its run
    directory too, which names the checkpoint taken), another Lightning project's (`model._orig_mod.`), a DDP module's
    state_dict (`module.`), a timm training checkpoint (with its pickled argparse arguments), a safetensors file (by
    its content, whatever its name) and this template's sharded checkpoint: the same tensors, bit for bit."""
    exported = torch.load(source / "net.pt", weights_only=True)
    torch.save(exported, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    net = {f"net.{k}": v for k, v in exported.items()}
    torch.save(
        {"state_dict": {f"model._orig_mod.{k}": v for k, v in exported.items()}, "pytorch-lightning_version": "2.5.0"},
        tmp_path / "other.ckpt",
    )
    torch.save({f"module.{k}": v for k, v in exported.items()}, tmp_path / "ddp.pt")
    # as timm's CheckpointSaver writes it (timm/utils/checkpoint_saver.py)
    timm = {"epoch": 3, "arch": "digits_cnn", "state_dict": exported, "version": 2, "metric": 0.9}
    torch.save({**timm, "args": argparse.Namespace(model="digits_cnn", lr=0.1)}, tmp_path / "timm.pth.tar")
    sharded = tmp_path / "sharded.ckpt"
    dcp.save({"state_dict": net}, checkpoint_id=sharded, no_dist=True)
    torch.save({"global_step": 19, "epoch": 0}, sharded / "meta.pt")  # Lightning's meta.pt beside the shards
    save_file(exported, tmp_path / "model.safetensors")
    save_file({f"model.{k}": v for k, v in exported.items()}, tmp_path / "pytorch_weights.bin")
    (best,) = (source / "checkpoints").glob("best-*.ckpt")

    kinds = {
        source / "net.pt": "a state_dict",
        tmp_path / "old.pt": "a state_dict",
        source / "checkpoints" / "last.ckpt": "a checkpoint of this template (step 19), its state_dict",
        source: f"a checkpoint of this template (step 19), its state_dict, from {best}",  # a run directory: its best
        tmp_path / "other.ckpt": "a Lightning checkpoint, its state_dict",
        tmp_path / "ddp.pt": "a state_dict",
        tmp_path / "timm.pth.tar": "a timm checkpoint (digits_cnn), its state_dict",
        sharded: "a sharded checkpoint of this template (step 19)",
        tmp_path / "model.safetensors": "a safetensors file",
        tmp_path / "pytorch_weights.bin": "a safetensors file",
    }
    for path, kind in kinds.items():
        assert open_weights(str(path)).kind == kind
        assert_same_weights(loaded_net(path), exported, rtol=0, atol=0)
    whole = loaded_net(source, module="")  # into the whole LightningModule: the checkpoint's keys as they are
    assert_same_weights(whole, exported, rtol=0, atol=0)


def test_a_file_that_would_run_code_is_refused(tmp_path):
    torch.save({"state_dict": {}, "config": Path("x")}, tmp_path / "pickled.ckpt")  # a class to import on load
    with pytest.raises(UserError, match=r"^refused to load .*pickled.ckpt: it contains pickled Python objects"):
        open_weights(str(tmp_path / "pickled.ckpt"))


def test_torchvision_weights_load_from_the_hub_cache_with_a_new_head(tmp_path, monkeypatch):
    """torchvision's ResNet-18 ImageNet weights by name, through torchvision's loader, from torch's hub cache (here
    a file of torchvision's own ResNet-18 with 1000 classes; nothing is downloaded): into a 10-class ResNet-18, the
    head's two tensors differ in shape, refused in one line until init.skip names them."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    (tmp_path / "hub" / "checkpoints").mkdir(parents=True)
    imagenet = torchvision.models.resnet18().state_dict()
    torch.save(imagenet, tmp_path / "hub" / "checkpoints" / "resnet18-f37072fd.pth")
    model = fresh({"_target_": "testbed.models.resnet", "name": "resnet18", "num_classes": 10})
    name = "torchvision:ResNet18_Weights.IMAGENET1K_V1"
    with pytest.raises(UserError) as refused:
        match(open_weights(name), model.net, settings(weights=name))
    assert str(refused.value) == (
        f"init.weights={name}: fc.weight of net has another shape in the file (file [1000, 512], model [10, 512]) "
        "(and 1 more: fc.bias), so it would stay as built; name what may stay new in init.skip (e.g. "
        "init.skip=[fc]), or load into another module (init.module) or from another key prefix of the file "
        "(init.prefix)"
    )
    file = open_weights(name)
    matched = match(file, model.net, settings(weights=name, skip=["fc"]))
    assert file.kind == f"torchvision's weights, from {tmp_path}/hub/checkpoints/resnet18-f37072fd.pth"
    assert matched.mismatched == {
        "fc.weight": "file [1000, 512], model [10, 512]",
        "fc.bias": "file [1000], model [10]",
    }
    head = {k: v.clone() for k, v in model.net.fc.state_dict().items()}
    load(model, "net", matched, file, None)
    for key, value in model.net.state_dict().items():
        expected = head[key.removeprefix("fc.")] if key.startswith("fc.") else imagenet[key]
        assert torch.equal(value, expected), key


def test_a_cut_safetensors_file_is_one_line(source, tmp_path):
    """safetensors checks its header against the file's size: a file cut short is refused when it is opened."""
    save_file(torch.load(source / "net.pt", weights_only=True), tmp_path / "model.safetensors")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes((tmp_path / "model.safetensors").read_bytes()[:-100])
    with pytest.raises(UserError) as refused:
        open_weights(str(cut))
    # the rest is safetensors' own words, which differ between its versions
    assert str(refused.value).startswith(f"{cut} is not a readable safetensors file (Error while deserializing header")


@pytest.mark.slow
def test_1_process_2_ddp_and_2_fsdp_processes_start_and_end_alike_with_frozen_weights_untouched(
    source, tuned, tmp_path
):
    """The recipe on 2 DDP processes and on 2 FSDP processes built on the meta device (each rank filling its shards
    from the file, one tensor at a time): every tensor on every rank as training starts equals the 1-process run's,
    and after an epoch to TOLERANCE (float64); the frozen parameters and the BatchNorm statistics are still the
    file's, bit for bit; the new head starts as built, the same on every topology. Each process builds the module
    once, and the runs print no warning (no BatchNorm one either: every BatchNorm layer is frozen)."""
    exported = torch.load(source / "net.pt", weights_only=True)
    runs = {"one": tuned}
    for name, strategy in (("ddp", "strategy=ddp"), ("fsdp", "strategy=fsdp")):
        runs[name] = tmp_path / name
        counted = ["model._target_=probes.CountedBuilds", f"+model.builds={tmp_path / name}-builds"]
        weights = f"init.weights={source / 'net.pt'}"
        result = check(run([*RECIPE, weights, *counted, "trainer.devices=2", strategy, f"hydra.run.dir={runs[name]}"]))
        assert "warning" not in (result.stdout + result.stderr).lower(), name
        builds = sorted(path.name.split("-") for path in (tmp_path / f"{name}-builds").iterdir())
        assert [count for _, count in builds] == ["0", "0"] and builds[0][0] != builds[1][0], builds
    assert "built on the meta device" in (runs["fsdp"] / "train.log").read_text()
    starts = {name: torch.load(path / "start" / "start0.pt", weights_only=True) for name, path in runs.items()}
    ends = {name: load_checkpoint(path / "checkpoints" / "last.ckpt")["state_dict"] for name, path in runs.items()}
    for name in ("ddp", "fsdp"):
        for rank in (0, 1):
            assert_same_weights(torch.load(runs[name] / "start" / f"start{rank}.pt"), starts["one"], rtol=0, atol=0)
        assert_same_weights(ends[name], ends["one"], rtol=0, atol=TOLERANCE)
    for name, state in [*starts.items(), *ends.items()]:
        for key, value in exported.items():
            if key in FROZEN or "running_" in key:
                assert torch.equal(state[f"net.{key}"], value.double()), (name, key)
    assert not torch.equal(starts["one"]["net.13.weight"], exported["13.weight"].double())  # as built
    assert not torch.equal(ends["one"]["net.13.weight"], starts["one"]["net.13.weight"])  # trained


def test_the_plan_shows_where_the_weights_came_from_and_what_was_left_new(source, tuned):
    log = (tuned / "train.log").read_text()
    file = source / "net.pt"
    assert (
        f"initial weights: {file} (a state_dict)\n"
        "  loaded         18 of 20 tensors of net (its keys as they are)\n"
        "  left as built  13.weight, 13.bias\n"
        "  frozen         0.weight, 1.weight, 1.bias, 3.weight, 4.weight, 4.bias\n"
        "  BatchNorm      eval mode in training: the weights' running statistics, never updated\n"
    ) in log
    row = (
        f"{file} (a state_dict) into net: 18 of 20 tensors loaded, 2 left as built; 6 parameters frozen (init.freeze); "
        "BatchNorm in eval mode: running statistics fixed (init.freeze_bn)"
    )
    assert f"  initial weights       {row}\n" in log
    plan = read_json(tuned / "plan.json")
    assert plan["init"] == {
        "weights": str(file),
        "weights_kind": "a state_dict",
        "module": "net",
        "tensors": 20,
        "loaded": 18,
        "left_as_built": 2,
        "frozen": 6,
        "freeze_bn": True,
    }


def test_a_fine_tuned_run_evaluates_and_exports(tuned, tmp_path):
    metrics = in_process([f"ckpt_path={tuned}", f"hydra.run.dir={tmp_path}"], job="eval")
    assert metrics["test/acc"] == read_json(tuned / "metrics.json")["test/acc"]
    for name in ("net.pt", "net.safetensors"):
        in_process([f"ckpt_path={tuned}", f"output_path={tmp_path / name}", f"hydra.run.dir={tmp_path}"], job="export")
    net = instantiate(OmegaConf.load(tuned / "config.yaml").model.net)
    exported = torch.load(tmp_path / "net.pt", weights_only=True)
    net.load_state_dict(exported)  # strict
    net.load_state_dict(load_file(tmp_path / "net.safetensors"))  # strict
    assert_same_weights(load_file(tmp_path / "net.safetensors"), exported, rtol=0, atol=0)


def test_a_resumed_fine_tuning_run_continues_from_its_checkpoint_not_the_initial_weights(tuned, tmp_path):
    """Resumed for a second epoch with init.weights naming a file that is gone: nothing is read from it, training
    starts from the checkpoint's weights, and the plan says so."""
    run_dir = tmp_path / "run"
    shutil.copytree(tuned, run_dir)
    resumed = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["state_dict"]
    gone = tmp_path / "gone.pt"
    in_process([*RECIPE, f"init.weights={gone}", "ckpt_path=last", "trainer.max_epochs=2", f"hydra.run.dir={run_dir}"])
    assert_same_weights(torch.load(run_dir / "start" / "start0.pt", weights_only=True), resumed, rtol=0, atol=0)
    log = (run_dir / "train.log").read_text()
    assert f"not loaded  the run resumes from {run_dir}/checkpoints/last.ckpt (its trained weights)" in log
    assert f"{gone}: not loaded, the run resumes from its checkpoint (its trained weights)" in log
    plan = read_json(run_dir / "plan.json")
    assert (plan["init"]["weights"], plan["init"]["loaded"], plan["init"]["tensors"]) == (str(gone), None, None)
    # what init.freeze_bn sets in the plan is set after the resume compares plans: not a change
    assert f"resuming from {run_dir}/checkpoints/last.ckpt; changed since: total_steps 19 -> 38\n" in log


def test_a_dry_run_plans_without_a_weights_file_that_is_not_on_this_machine(tmp_path):
    """A dry run on a laptop plans a cluster's run whose weights file is on the cluster: the plan says the file was
    not checked; the run itself refuses a file that is not there (test_errors: 'initial weights missing')."""
    elsewhere = "/cluster/weights/net.pt"
    plan = in_process(
        ["dry_run=true", f"init.weights={elsewhere}", "init.skip=[13]", "init.freeze=[0]", f"hydra.run.dir={tmp_path}"]
    )
    initial = plan["init"]
    assert (initial["weights"], initial["weights_kind"], initial["loaded"], initial["frozen"]) == (
        elsewhere,
        NOT_HERE,
        None,
        1,
    )
    log = (tmp_path / "train.log").read_text()
    assert f"initial weights: {elsewhere}\n  not checked  {NOT_HERE}\n" in log
    assert f"  initial weights       {elsewhere}: {NOT_HERE}; 1 parameters frozen (init.freeze)\n" in log


def test_the_plan_warns_when_pretrained_batchnorm_statistics_see_another_batch(source, tmp_path):
    """The source trained with 64 samples per BatchNorm statistic (stored in its checkpoint): fine-tuned with 32, the
    plan warns; with init.freeze_bn, or with 64, it does not."""
    ckpt = source / "checkpoints" / "last.ckpt"
    common = [f"init.weights={ckpt}", "dry_run=true"]
    plan = in_process([*common, "data.global_batch_size=32", f"hydra.run.dir={tmp_path / 'a'}"])
    assert plan["trained_bn_batch_size"] == 64 and plan["bn_batch_size"] == 32
    assert (
        "BatchNorm statistics come from 32 samples, and the initial weights were trained with 64 (init.bn_batch_size): "
        "their running statistics drift from the ones the weights expect. Options: 64 samples per device (a larger "
        "global batch, or fewer devices), or init.freeze_bn=true"
    ) in (tmp_path / "a" / "train.log").read_text()
    frozen = in_process(
        [*common, "init.freeze_bn=true", "data.global_batch_size=32", f"hydra.run.dir={tmp_path / 'b'}"]
    )
    same = in_process([*common, f"hydra.run.dir={tmp_path / 'c'}"])
    assert frozen["trained_bn_batch_size"] is None and same["trained_bn_batch_size"] == 64
    assert "initial weights were trained with" not in (tmp_path / "c" / "train.log").read_text()


def test_a_partial_freeze_bn_warns_of_the_batchnorm_layers_that_still_compute_batch_statistics(tmp_path):
    """init.freeze_bn with init.module=net.1 keeps that BatchNorm layer in eval mode; net.4 and net.8 still compute
    statistics over micro-batches of 8: the plan and its warning name them (the warning spoke of BatchNorm as a whole,
    as if no layer were frozen). With every layer frozen (init.module=net), no BatchNorm warning."""
    common = ["dry_run=true", "init.freeze_bn=true", "data.global_batch_size=8"]
    some = in_process([*common, "init.module=net.1", f"hydra.run.dir={tmp_path / 'some'}"])
    assert (list(some["batchnorm_unfrozen"]), some["batchnorm_frozen"], some["bn_batch_size"]) == (
        ["net.4", "net.8"],
        False,
        8,
    )
    assert (
        "BatchNorm statistics in net.4, net.8 (init.freeze_bn keeps those in net.1 in eval mode) come from 8 samples "
        "(the micro-batch): the recipe was tuned with 64"
    ) in (tmp_path / "some" / "train.log").read_text()
    every = in_process([*common, "init.module=net", f"hydra.run.dir={tmp_path / 'every'}"])
    assert (list(every["batchnorm_unfrozen"]), every["batchnorm_frozen"]) == ([], True)
    assert "BatchNorm statistics" not in (tmp_path / "every" / "train.log").read_text()


def test_build_optimizer_gives_named_parameters_their_lr_and_leaves_frozen_ones_out():
    """`lr_scales={net.13: 5}`: the head's weight and bias in groups of their own at 5x the base LR, which the LR
    scaling multiplies like every group; a frozen parameter is in no group."""
    from scaleup.optim import build_optimizer

    model = fresh()
    model.net[0].weight.requires_grad_(False)
    optimizer = build_optimizer({"_target_": "torch.optim.SGD", "lr": 0.1}, model, {"net.13": 5})
    names = {id(p): name for name, p in model.named_parameters()}
    groups = {g["name"]: (g["lr"], sorted(names[id(p)] for p in g["params"])) for g in optimizer.param_groups}
    assert groups == {
        "decay": (0.1, ["net.3.weight", "net.7.weight"]),
        "no_decay": (0.1, sorted(f"net.{i}.{kind}" for i in (1, 4, 8) for kind in ("weight", "bias"))),
        "decay@net.13": (0.5, ["net.13.weight"]),
        "no_decay@net.13": (0.5, ["net.13.bias"]),
    }


def test_a_file_that_fits_under_two_prefixes_needs_init_prefix_and_its_other_tensors_are_listed(source, tmp_path):
    """A distillation checkpoint holds a teacher and a student of the same shapes: which one is meant is the user's
    to say (one line naming both); with init.prefix=student. the student loads, and the teacher's tensors and a
    loss's buffer are listed as not used."""
    exported = torch.load(source / "net.pt", weights_only=True)
    teacher = {f"teacher.{k}": torch.zeros_like(v) for k, v in exported.items()}
    student = {f"student.{k}": v for k, v in exported.items()}
    torch.save({"state_dict": {**teacher, **student, "loss.weight": torch.ones(10)}}, tmp_path / "distilled.ckpt")
    path = str(tmp_path / "distilled.ckpt")
    with pytest.raises(UserError) as refused:
        loaded_net(path)
    assert str(refused.value) == (
        f"init.weights={path}: its tensors fit net under several key prefixes ('student.', 'teacher.'): choose one "
        "with init.prefix=<prefix>"
    )
    assert_same_weights(loaded_net(path, prefix="student."), exported, rtol=0, atol=0)
    matched = match(open_weights(path), fresh().net, settings(weights=path, prefix="student."))
    assert matched.unused == [*teacher, "loss.weight"] and matched.prefix == "student."


def test_the_key_prefix_is_judged_by_names_and_shapes(source, tmp_path):
    """A file whose names fit the network under two prefixes, with its shapes under one only (a wider teacher beside
    the student): the student loads without init.prefix. torchvision's ResNet-18 into the digits CNN fits by names
    under its downsample blocks (0.weight, 1.weight, ...) and by no shape: another architecture, in one line, also
    into net.0 (a convolution: `weight` under every prefix)."""
    exported = torch.load(source / "net.pt", weights_only=True)
    wider = fresh({**DIGITS_NET, "width": 16}).net.state_dict()
    path = tmp_path / "distilled.ckpt"
    torch.save(
        {
            "state_dict": {
                **{f"teacher.{k}": v for k, v in wider.items()},
                **{f"student.{k}": v for k, v in exported.items()},
            }
        },
        path,
    )
    assert_same_weights(loaded_net(path), exported, rtol=0, atol=0)

    resnet = tmp_path / "resnet18.pt"
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), resnet)
    for module, example in (
        ("net", "layer2.0.downsample.0.weight is [128, 64, 1, 1], 0.weight of net [32, 1, 3, 3]"),
        ("net.0", "conv1.weight is [64, 3, 7, 7], weight of net.0 [32, 1, 3, 3]"),
    ):
        with pytest.raises(UserError) as refused:
            loaded_net(resnet, module=module)
        assert str(refused.value) == (
            f"init.weights={resnet}: another architecture: no tensor of it fits {module} by name and shape (e.g. "
            f"{example}); build the network it is for (model.net), or load it into the submodule it fits "
            "(init.module)"
        )


def test_frozen_batchnorm_stays_in_eval_mode_after_lightning_converts_it_to_syncbatchnorm():
    """init.freeze_bn on GPUs with trainer.sync_batchnorm: the layers Lightning puts in place of BatchNorm at set-up
    run in eval mode too, so their statistics stay the weights' (without a process group a SyncBatchNorm in training
    mode computes as BatchNorm does here, and would update them)."""
    from lightning.pytorch.plugins import TorchSyncBatchNorm

    model = fresh()
    prepare_start(settings(freeze_bn=True), model)
    model = TorchSyncBatchNorm().apply(model)
    before = model.net[1].running_mean.clone()
    model.train()
    model.net(torch.randn(4, 1, 8, 8))
    norms = [layer for layer in model.net.modules() if isinstance(layer, torch.nn.SyncBatchNorm)]
    assert len(norms) == 3 and not any(layer.training for layer in norms)
    assert torch.equal(model.net[1].running_mean, before)
