"""Every user mistake ends in one message naming the fix and exit code 2, never a traceback.

The matrix runs each job in this process, with the config composed from the same overrides a user would type, and
turns what it raises into the message the entry point would print (`as_user_error`, what `exit_on_user_error` uses).
The table of wrong values (config/schema.py: a type or a range) and a handful of other cases run the real entry
points, to check the exit code, the error line, that no traceback is printed and that nothing was written or
downloaded: all of them in one interpreter (engine/tests/entry_point_cases.py), which starts once for all.
"""

import json
import os
import runpy
import shutil
import sys
import zipfile
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import pytest
import torch
from pydantic import Field

from conftest import ROOT, TESTS, check, engine_section, in_process, run_command
from scaleup.config.schema import validate_config
from scaleup.errors import EXIT_USER_ERROR, UserError, as_user_error
from scaleup.trainer import check_trainer_arguments
from user_modules import SCHEDULER_REFUSED

QUIET = [
    "logger=none",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "trainer.num_sanity_val_steps=0",
]
TINY_RUN = ["debug=limit", "trainer.max_epochs=1", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    """Files the cases point at: a real checkpoint from a tiny run, a truncated one, a bare state_dict, ..."""
    tmp = tmp_path_factory.mktemp("errors")
    in_process([*TINY_RUN, *QUIET, "model.net.width=8", f"hydra.run.dir={tmp / 'run'}"])
    ckpt = tmp / "run" / "checkpoints" / "last.ckpt"
    (tmp / "truncated.ckpt").write_bytes(ckpt.read_bytes()[:1000])
    for size in (5_000, 50_000):  # cut here, torch's zip reader fails with an OSError (EINVAL), not a RuntimeError
        (tmp / f"cut{size}.ckpt").write_bytes(ckpt.read_bytes()[:size])
    torch.save({"net.0.weight": torch.zeros(1)}, tmp / "state_dict.pt")
    # What plain Lightning writes for the same module: the run's checkpoint without the template's config and plan
    lightning = {key: value for key, value in torch.load(ckpt, weights_only=True).items() if key != "scaleup"}
    torch.save(lightning, tmp / "lightning.ckpt")
    (tmp / "changed.ckpt").write_bytes(with_a_byte_changed_in_its_largest_tensor(ckpt))
    (tmp / "exists.pt").write_bytes(b"")
    # text torch's weights-only unpickler fails on with a KeyError (101: "e") and with an IndexError
    (tmp / "notes.txt").write_text("hello world\n")
    (tmp / "notes.yaml").write_text("epoch: 3\n")
    (tmp / "empty").mkdir()
    (tmp / "started").mkdir()  # a run directory as a run leaves it before its training ends: no metrics.json yet
    shutil.copy(tmp / "run" / "plan.json", tmp / "started")
    return {"tmp": str(tmp), "ckpt": str(ckpt)}


def with_a_byte_changed_in_its_largest_tensor(ckpt: Path) -> bytes:
    """The bytes of `ckpt` with one byte of its largest tensor changed: torch.load reads it without complaint."""
    data = bytearray(ckpt.read_bytes())
    with zipfile.ZipFile(ckpt) as archive:
        entry = max(archive.infolist(), key=lambda info: info.file_size)
    start = entry.header_offset + 30 + len(entry.filename.encode()) + len(entry.extra)  # after the local header
    data[start + entry.file_size // 2] ^= 0xFF
    return bytes(data)


# (id, job, overrides, a piece of the expected message). {tmp} and {ckpt} are filled in from `paths`.
CASES = [
    # config values that pass the schema (config/schema.py) but not the objects built from them
    # an argument the constructor does not take: refused by its signature before the call
    (
        "unknown net argument",
        "train",
        ["+model.net.depth=3"],
        "model.net.depth: DigitsCNN takes no argument 'depth' (its arguments: dropout, in_channels, norm, num_classes, "
        "width)",
    ),
    (
        "unknown callback argument",  # a callback without an __init__ of its own takes none
        "train",
        ["+callbacks.reductions={{_target_:user_modules.ReductionLogger,every:2}}"],
        "callbacks.reductions.every: ReductionLogger takes no argument 'every' (it takes none)",
    ),
    (
        "unknown data argument",  # followed through the data module's **loader_kwargs to the engine's base class
        "train",
        ["+data.colour=red"],
        "data.colour: DigitsDataModule takes no argument 'colour' (its arguments: augment, global_batch_size,",
    ),
    (
        "diagnostics_from without a dry run",
        "train",
        ["diagnostics_from={tmp}"],
        "diagnostics_from={tmp} is read by a dry run only: add dry_run=true to get the speedup estimate for this "
        "topology",
    ),
    (
        "diagnostics_from a directory without a run",
        "train",
        ["diagnostics_from={tmp}/empty", "dry_run=true"],
        "diagnostics_from={tmp}/empty has no plan.json and no metrics.json: pass the directory of a training run "
        "whose training ended (a run writes plan.json when it starts and metrics.json when its training ends)",
    ),
    (
        "diagnostics_from a run that has not ended its training",
        "train",
        ["diagnostics_from={tmp}/started", "dry_run=true"],
        "diagnostics_from={tmp}/started has no metrics.json: pass the directory",
    ),
    (
        "diagnostics_from a path that is no directory",
        "train",
        ["diagnostics_from={tmp}/missing", "dry_run=true"],
        "diagnostics_from={tmp}/missing is not a directory: pass the directory",
    ),
    (
        "diagnostics_from without the diagnostics callback",
        "train",
        ["diagnostics_from={tmp}/run", "dry_run=true", "callbacks=[]"],
        "diagnostics_from={tmp}/run: no callback of this run estimates from it; the diagnostics callback does",
    ),
    (
        "indivisible batch",
        "train",
        ["data.global_batch_size=100", "trainer.accelerator=cpu", "trainer.devices=3", "dry_run=true"],
        "data.global_batch_size=100 does not divide into 3 device(s) x 1 accumulation step(s) = 3 equal per-device "
        "batches; choose a global batch that is a multiple of 3 (e.g. 99)",
    ),
    ("both batch sizes", "train", ["data.per_device_batch_size=8"], "set exactly one of data.global_batch_size"),
    ("batch above data", "train", ["data.global_batch_size=4096"], "larger than the training set (1257 samples)"),
    ("no training data", "train", ["data.val_size=1500"], "leave no training data out of 1797"),
    ("two warmups", "train", ["lr_schedule.warmup_steps=5"], "warmup_epochs or lr_schedule.warm"),
    ("shuffle", "train", ["+data.shuffle=true"], "remove data.shuffle"),
    ("tiny limit", "train", ["trainer.limit_train_batches=0.01"], "limit_train_batches=0.01 keeps less than one"),
    (
        "validation interval beyond the epoch",  # Lightning refuses it once fit has started
        "train",
        ["trainer.val_check_interval=500", "dry_run=true"],
        "trainer.val_check_interval=500 is more than the 19 training batches of an epoch on each device: validate "
        "every N <= 19 batches, every share of an epoch (0.5), or every 500 batches across epochs with "
        "trainer.check_val_every_n_epoch=null",
    ),
    (
        "bad interpolation",
        "train",
        ["data.num_workers=${{nowhere}}"],
        "the config does not resolve (at data.num_workers): Interpolation key 'nowhere' not found",
    ),
    ("trainer argument", "train", ["+trainer.colour=red", *QUIET], "trainer.colour is not a key of trainer"),
    # devices
    ("fp16 on cpu", "train", ["trainer.precision=16-mixed", "trainer.accelerator=cpu"], "16-mixed needs a GPU"),
    (
        "syncbn on cpu",
        "train",
        ["trainer.sync_batchnorm=true", "trainer.accelerator=cpu", "trainer.devices=2", "dry_run=true"],
        "trainer.sync_batchnorm=true cannot run on CPU",
    ),
    (
        "syncbn with fsdp",
        "train",
        [
            "strategy=fsdp",
            "trainer.sync_batchnorm=true",
            "trainer.accelerator=cpu",
            "trainer.devices=2",
            "dry_run=true",
        ],
        "trainer.sync_batchnorm=true does not run with strategy=fsdp",
    ),
    (
        "fsdp offload on cpu",
        "train",
        ["strategy=fsdp", "strategy.cpu_offload=true", "trainer.accelerator=cpu", "trainer.devices=2", "dry_run=true"],
        "strategy.cpu_offload=true moves the shards off the GPU",
    ),
    (
        "hybrid sharding on one node",
        "train",
        ["strategy=fsdp", "strategy.sharding=hybrid", "trainer.devices=2", "dry_run=true"],
        "strategy.sharding=hybrid shards within a node and replicates across nodes, and this run has one node",
    ),
    (
        "compile with fsdp",
        "train",
        ["strategy=fsdp", "model.compile=true", "trainer.devices=2", "dry_run=true"],
        "model.compile=true with strategy=fsdp: torch.compile stops at the hooks FSDP puts on every unit",
    ),
    (
        "async save of one-file checkpoints",
        "train",
        ["checkpoint.async_save=true", "trainer.devices=1", "dry_run=true"],
        "checkpoint.async_save=true writes sharded checkpoints (strategy=fsdp on 2 or more processes) in the "
        "background; this run writes one-file checkpoints, which are saved at once: use auto or false",
    ),
    (
        "fsdp units match nothing",
        "train",
        ["strategy=fsdp", "strategy.shard_modules=[torch.nn.LSTM]", "trainer.devices=2", "dry_run=true"],
        "strategy.shard_modules=['torch.nn.LSTM'] matches no module of ImageClassifier",
    ),
    # manual optimization (a module that steps its optimizers itself): Lightning cannot accumulate there
    (
        "manual optimization with accumulation",
        "train",
        ["model=two_optimizers", "trainer.accumulate_grad_batches=2", "dry_run=true"],
        "trainer.accumulate_grad_batches=2, but TwoOptimizerGAN sets automatic_optimization=False, and Lightning "
        "cannot accumulate gradients under manual optimization: remove it: each device then computes its whole share "
        "of the global batch at once",
    ),
    (
        "manual optimization with the auto cap",
        "train",
        ["model=two_optimizers", "data.max_per_device_batch_size=auto", "dry_run=true"],
        "data.max_per_device_batch_size=auto derives a gradient accumulation, but TwoOptimizerGAN sets "
        "automatic_optimization=False, and Lightning cannot accumulate gradients under manual optimization: give the "
        "cap as a number that the per-device share of the global batch fits in, or drop it",
    ),
    (
        "manual optimization with a cap that needs accumulation",
        "train",
        ["model=two_optimizers", "data.max_per_device_batch_size=32", "trainer.devices=1", "dry_run=true"],
        "data.global_batch_size=64 on 1 device(s) is 64 samples per device, above data.max_per_device_batch_size=32: "
        "the cap derives 2 accumulation steps, but TwoOptimizerGAN sets automatic_optimization=False, and Lightning "
        "cannot accumulate gradients under manual optimization. Run on 2 devices, raise the cap to 64, or lower the "
        "global batch",
    ),
    # checkpoints
    ("missing checkpoint", "train", ["ckpt_path={tmp}/nope.ckpt"], "checkpoint {tmp}/nope.ckpt does not exist"),
    (
        "another network",
        "train",
        ["ckpt_path={ckpt}"],
        "was trained with another network: model.net.width=8 (now 32); resume with the same model settings, or start "
        "a new run from its weights: init.weights={ckpt} (with init.skip naming what is new: docs/finetuning.md)",
    ),
    (
        "finished checkpoint",
        "train",
        ["ckpt_path={ckpt}", "model.net.width=8", *TINY_RUN],
        "already at or past this plan's 4 steps",
    ),
    ("eval without checkpoint", "eval", [], "ckpt_path has no value (it is ??? in the config): pass ckpt_path="),
    ("truncated checkpoint", "eval", ["ckpt_path={tmp}/truncated.ckpt"], "is not a readable checkpoint"),
    ("checkpoint cut at 5 kB", "eval", ["ckpt_path={tmp}/cut5000.ckpt"], "cut5000.ckpt is not a readable checkpoint"),
    (
        "checkpoint with a changed byte",
        "eval",
        ["ckpt_path={tmp}/changed.ckpt"],
        "{tmp}/changed.ckpt is not a readable checkpoint: corrupt (",
    ),
    (
        "checkpoint cut at 50 kB to resume",
        "train",
        ["ckpt_path={tmp}/cut50000.ckpt"],
        "{tmp}/cut50000.ckpt is not a readable checkpoint: truncated or corrupt ([Errno 22] Invalid argument)",
    ),
    (
        "state_dict to resume",
        "train",
        ["ckpt_path={tmp}/state_dict.pt"],
        "{tmp}/state_dict.pt holds weights only (a plain state_dict, e.g. an export), not a run to resume: ckpt_path "
        "takes a checkpoint that train.py wrote, e.g. <run dir>/checkpoints/last.ckpt; a new run starts from these "
        "weights with init.weights={tmp}/state_dict.pt",
    ),
    (
        "export to evaluate",
        "eval",
        ["ckpt_path={tmp}/state_dict.pt"],
        "{tmp}/state_dict.pt holds weights only (a plain state_dict, e.g. an export): it stores no config to rebuild "
        "the model and data from. Pass a checkpoint a training run wrote (<run dir>/checkpoints/best-*.ckpt or "
        "last.ckpt), or start a run from these weights with init.weights={tmp}/state_dict.pt",
    ),
    (
        "plain Lightning checkpoint to export",
        "export",
        ["ckpt_path={tmp}/lightning.ckpt", "output_path={tmp}/lightning.pt"],
        "{tmp}/lightning.ckpt was not written by this template's train.py (a checkpoint of plain Lightning or other "
        "code): it stores no config",
    ),
    (
        "plain Lightning checkpoint of another network to resume",  # the run's width 8, the config's 32
        "train",
        ["ckpt_path={tmp}/lightning.ckpt"],
        "{tmp}/lightning.ckpt was not written by this template's train.py (it stores no model config) and its "
        "weights do not fit this model (16 tensors differ, e.g. net.0.weight: (8, 1, 3, 3) there, (32, 1, 3, 3) here): "
        "start a new run from its weights with init.weights={tmp}/lightning.ckpt (init.skip naming what is new: "
        "docs/finetuning.md)",
    ),
    ("text as checkpoint", "eval", ["ckpt_path={tmp}/notes.txt"], "{tmp}/notes.txt is not a PyTorch checkpoint"),
    (
        "text to export",
        "export",
        ["ckpt_path={tmp}/notes.yaml", "output_path={tmp}/text.pt"],
        "{tmp}/notes.yaml is not a PyTorch checkpoint",
    ),
    ("text to resume", "train", ["ckpt_path={tmp}/notes.txt"], "{tmp}/notes.txt is not a PyTorch checkpoint"),
    # initial weights (init.*): a tensor the file does not fill, unless init.skip names it
    (
        "initial weights without the new head",
        "train",
        ["init.weights={ckpt}", "model.net.width=8", "model.net.num_classes=5", "dry_run=true"],
        "init.weights={ckpt}: 13.weight of net has another shape in the file (file [10, 32], model [5, 32]) (and 1 "
        "more: 13.bias), so it would stay as built; name what may stay new in init.skip (e.g. init.skip=[13]), or "
        "load into another module (init.module) or from another key prefix of the file (init.prefix)",
    ),
    (
        "initial weights of another network",
        "train",
        ["init.weights={ckpt}", "init.skip=[13]", "dry_run=true"],
        "init.weights={ckpt}: 0.weight of net has another shape in the file (file [8, 1, 3, 3], model [32, 1, 3, 3])",
    ),
    ("initial weights missing", "train", ["init.weights={tmp}/nope.pt"], "init.weights={tmp}/nope.pt: no such file"),
    ("initial weights as text", "train", ["init.weights={tmp}/notes.txt"], "{tmp}/notes.txt is not a PyTorch checkp"),
    (
        "initial weights skip nothing",
        "train",
        ["init.weights={ckpt}", "model.net.width=8", "init.skip=[fc]"],
        "init.skip=fc names no tensor of net (e.g. 0.weight, 1.weight, 1.bias, 1.running_mean ... (20 in all))",
    ),
    (
        "initial weights with a changed byte",  # memory-mapped, and still checked: it would train to NaN
        "train",
        ["init.weights={tmp}/changed.ckpt", "dry_run=true"],
        "{tmp}/changed.ckpt is not a readable checkpoint: corrupt (",
    ),
    (
        "initial weights empty",
        "train",
        ["init.weights={tmp}/exists.pt", "dry_run=true"],
        "{tmp}/exists.pt is not a readable checkpoint: the file is empty (0 bytes)",
    ),
    (
        "initial weights prefix read as a number",
        "train",
        ["init.weights={ckpt}", "init.prefix=13.", "dry_run=true"],
        "init.prefix=13.0 must be a key prefix of the file as a string (quote a number: \"init.prefix='13.'\") or null",
    ),
    (
        "a new head frozen",
        "train",
        ["init.weights={ckpt}", "model.net.width=8", "init.skip=[13]", "init.freeze=[3,13]", "dry_run=true"],
        "init.freeze=[3,13] freezes 13.weight, 13.bias of net, which init.weights does not fill (init.skip leaves them "
        "as built): they would keep their random values; leave them out of init.freeze",
    ),
    ("frozen nothing", "train", ["init.freeze=[backbone]"], "init.freeze=backbone names no parameter (e.g. 0.weight"),
    (
        "frozen everything",
        "train",
        ["init.freeze=['.*']", "dry_run=true"],
        "init.freeze=[.*] freezes every parameter of the model (94,186 in 11 tensors): nothing would train; name only "
        "what stays fixed, e.g. all but the last module: init.freeze=[0,1,3,4,7,8]",
    ),
    (
        "resumed with another freeze",
        "train",
        ["ckpt_path={ckpt}", "model.net.width=8", "init.freeze=[0]"],
        "{ckpt} trained 6,274 parameters (init.freeze=[]), this run would train 6,202 (init.freeze=[0]), and the "
        "optimizer's state is for those it trained: resume with init.freeze=[], or start a new run from its weights: "
        "init.weights={ckpt}",
    ),
    (
        "initial weights module",
        "train",
        ["init.module=backbone", "init.freeze=[0]"],
        "ImageClassifier has no submodule 'backbone'; its children are net, metrics: pass init.module=<one of them>",
    ),
    (
        "initial weights module inside the network",
        "train",
        ["init.module=net.99", "init.freeze=[0]"],
        "ImageClassifier.net has no submodule '99'; its children are 0, 1, 2, 3, 4, 5, 6, 7 ... (14 in all): pass "
        "init.module=net.<one of them>",
    ),
    # output locations
    (
        "export into /proc",
        "export",
        ["ckpt_path={ckpt}", "output_path=/proc/nope/net.pt"],
        "/proc/nope: No such file or directory; check that path",
    ),
    ("export over a file", "export", ["ckpt_path={ckpt}", "output_path={tmp}/exists.pt"], "exists.pt already exists"),
]


@pytest.mark.parametrize(("job", "args", "expected"), [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_user_mistake_is_one_clear_message(job, args, expected, paths, tmp_path, monkeypatch):
    args = [arg.format(**paths) for arg in args]
    with pytest.raises(Exception) as raised:
        in_process([*args, f"hydra.run.dir={tmp_path}"], job=job)
    error = as_user_error(raised.value)
    assert error is not None, f"a traceback, not a user error: {raised.value!r}"
    assert expected.format(**paths) in str(error)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the mistake is asking for a GPU on a machine without one")
def test_gpu_on_a_cpu_machine(tmp_path):
    with pytest.raises(Exception) as raised:
        in_process(["trainer.accelerator=gpu", f"hydra.run.dir={tmp_path}"])
    assert "trainer.accelerator=gpu but no GPU is visible; use trainer.accelerator=cpu" in str(
        as_user_error(raised.value)
    )


def test_launcher_and_config_disagree(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(Exception) as raised:
        in_process(["trainer.accelerator=cpu", "trainer.devices=2", f"hydra.run.dir={tmp_path}"])
    assert str(as_user_error(raised.value)) == (
        "torchrun started 4 process(es) but trainer.devices x trainer.num_nodes = 2 x 1 = 2; make them equal "
        "(e.g. trainer.devices=4 trainer.num_nodes=1)"
    )


# (script, overrides, the last line of stderr)
ENTRY_POINTS = {
    "eval without checkpoint": (
        "eval.py",
        ["hydra.run.dir={tmp}/eval"],
        "error: ckpt_path has no value (it is ??? in the config): pass ckpt_path=<value>",
    ),
    "export into /proc": (
        "export.py",
        ["ckpt_path={ckpt}", "output_path=/proc/nope/net.pt"],
        "error: /proc/nope: No such file or directory; check that path in your overrides (a directory to write "
        "into must be creatable, a file to read must exist and be readable)",
    ),
    "scheduler returned by the module": (
        "train.py",
        ["model._target_=user_modules.SchedulerClassifier", "dry_run=true", "hydra.run.dir={tmp}/scheduler"],
        f"error: {SCHEDULER_REFUSED}",
    ),
    "run directory in /proc": (
        "train.py",
        ["hydra.run.dir=/proc/nope/run", "dry_run=true"],
        "error: cannot create the run directory /proc/nope/run: No such file or directory; pass "
        "hydra.run.dir=<a directory you can write> (or fix paths.log_dir)",
    ),
    # Hydra's own composition errors, before the job starts: one line with the closest match, not Hydra's message.
    "misspelled trainer key": (
        "train.py",
        ["trainer.max_epoch=1", "dry_run=true", "hydra.run.dir={tmp}/max_epoch"],
        "error: trainer.max_epoch is not a key of trainer; did you mean trainer.max_epochs?",
    ),
    "misspelled data option": (
        "train.py",
        ["data=digit", "dry_run=true", "hydra.run.dir={tmp}/digit"],
        "error: data=digit: there is no such option; did you mean data=digits? (the options: char_text, cifar10, "
        "digits, imagefolder, sharded, synthetic, synthetic_imagenet)",
    ),
    "unparsable override": (
        "train.py",
        ["trainer.max_epochs=[1", "dry_run=true", "hydra.run.dir={tmp}/grammar"],
        "error: trainer.max_epochs=[1: not an override Hydra can read (no viable alternative at input '[1'); write "
        "key=value, and quote a value with brackets, parentheses, commas or spaces: 'key=\"a value\"' "
        "(https://hydra.cc/docs/advanced/override_grammar/basic)",
    ),
    "misspelled eval key": (
        "eval.py",
        ["ckpt_pat=x.ckpt", "hydra.run.dir={tmp}/ckpt_pat"],
        "error: ckpt_pat: there is no such key; did you mean ckpt_path? (a key of your own: +ckpt_pat=VALUE)",
    ),
    "a trainer key the template sets": (
        "train.py",
        ["trainer.strategy=ddp_spawn", "dry_run=true", "hydra.run.dir={tmp}/trainer_strategy"],
        "error: trainer.strategy is set by the template, not in trainer: choose it with strategy.name=VALUE (ddp, "
        "ddp_spawn or fsdp; strategy=fsdp for FSDP's own keys)",
    ),
    # ... also in a sweep, for a key it does not vary (Hydra composes the sweep's config first)
    "misspelled key in a sweep": (
        "train.py",
        ["-m", "seed=1,2", "trainer.max_epoch=1", "dry_run=true", "hydra.sweep.dir={tmp}/sweep_typo"],
        "error: trainer.max_epoch is not a key of trainer; did you mean trainer.max_epochs?",
    ),
    # a refused run in a directory that holds an earlier one (a resume) leaves what is there
    "refused in an existing run directory": (
        "train.py",
        ["seed=-5", "hydra.run.dir={tmp}/existing"],
        "error: seed=-5 must be an integer in [0, 4294967295]",
    ),
    # a sweep checks every job before the first one starts
    "sweep with a wrong value": (
        "train.py",
        ["-m", "seed=1,-5", "dry_run=true", "hydra.sweep.dir={tmp}/sweep"],
        "error: sweep job 1 (seed=-5): seed=-5 must be an integer in [0, 4294967295]",
    ),
    # ... and plans every training job as its dry run would: what only the data and the model show (a model made for
    # other data; here a batch larger than the training set)
    "sweep with a batch larger than the data": (
        "train.py",
        ["-m", "data.global_batch_size=64,4096", "hydra.sweep.dir={tmp}/sweep_models"],
        "error: sweep job 1 (data.global_batch_size=4096): the global batch (4096) is larger than the training set "
        "(1257 samples); lower data.global_batch_size",
    ),
}

MAX_EPOCHS = "an integer >= 1 (or -1 for no limit, null for Lightning's default); 0 would train nothing"
DEVICES = (
    "an integer >= 1 (devices per node), -1 or auto (every visible device), or device ids as a list ([0, 1]) or a "
    'string with commas ("0,1")'
)
PRECISIONS = (
    "auto, 64, 32, 16, transformer-engine, transformer-engine-float16, 16-true, 16-mixed, bf16-true, "
    "bf16-mixed, 32-true, 64-true, bf16"
)
EPOCH_SHARE = "null, an integer >= 1 (batches) or a number in (0, 1] (of the epoch); 0 would train nothing"
FSDP_KEY = (
    "strategy.sharding is a key of strategy=fsdp, and this run has strategy.name=ddp, which would ignore it: pass "
    "strategy=fsdp strategy.sharding=VALUE, or leave strategy.sharding out"
)

# A wrong type or range in every section: (script, overrides, the whole error line after "error: "). Each one must
# stop before anything is written, downloaded or started. The eval and export cases name checkpoints that do not
# exist: the values are checked first.
WRONG_VALUES = {
    # the examples
    "global batch abc": (
        "train.py",
        ["data.global_batch_size=abc"],
        "data.global_batch_size=abc must be an integer >= 1 or null",
    ),
    "max_epochs abc": ("train.py", ["trainer.max_epochs=abc"], f"trainer.max_epochs=abc must be {MAX_EPOCHS}"),
    "base batch 0": (
        "train.py",
        ["lr_schedule.base_batch_size=0"],
        "lr_schedule.base_batch_size=0 must be an integer >= 1",
    ),
    "workers -1": ("train.py", ["data.num_workers=-1"], "data.num_workers=-1 must be an integer >= 0"),
    "max_epochs -2": ("train.py", ["trainer.max_epochs=-2"], f"trainer.max_epochs=-2 must be {MAX_EPOCHS}"),
    "max_epochs 0": ("train.py", ["trainer.max_epochs=0"], f"trainer.max_epochs=0 must be {MAX_EPOCHS}"),
    "lr abc": ("train.py", ["model.optimizer.lr=abc"], "model.optimizer.lr=abc must be a number > 0"),
    # the top level and the template's own sections
    "seed abc": ("train.py", ["seed=abc"], "seed=abc must be an integer in [0, 4294967295]"),
    "dry_run maybe": ("train.py", ["dry_run=maybe"], "dry_run=maybe must be true or false"),
    "ckpt_path number": ("train.py", ["ckpt_path=5"], "ckpt_path=5 must be a checkpoint path, last, or null"),
    "monitor mode": ("train.py", ["monitor.mode=up"], "monitor.mode=up must be one of min, max"),
    "tf32 yes": ("train.py", ["performance.tf32=yes"], "performance.tf32=yes must be true or false"),
    "scaling rule": (
        "train.py",
        ["lr_schedule.rule=cubic"],
        "lr_schedule.rule=cubic must be one of linear, sqrt, none",
    ),
    "warmup epochs -1": (
        "train.py",
        ["lr_schedule.warmup_epochs=-1"],
        "lr_schedule.warmup_epochs=-1 must be a number >= 0 or null",
    ),
    "decay": ("train.py", ["lr_schedule.decay=exp"], "lr_schedule.decay=exp must be one of cosine, step, none"),
    "milestones": (
        "train.py",
        ["lr_schedule.milestones=[30,-5]"],
        "lr_schedule.milestones=[30, -5] must be a list of numbers >= 0 or null",
    ),
    "gamma 0": ("train.py", ["lr_schedule.gamma=0"], "lr_schedule.gamma=0 must be a number > 0"),
    "strategy name": (
        "train.py",
        ["strategy.name=horovod"],
        "strategy.name=horovod must be one of ddp, ddp_spawn, fsdp",
    ),
    "bucket abc": ("train.py", ["strategy.bucket_cap_mb=abc"], "strategy.bucket_cap_mb=abc must be a number > 0"),
    "fsdp mixed precision": (
        "train.py",
        ["strategy=fsdp", "strategy.mixed_precision=fp8"],
        "strategy.mixed_precision=fp8 must be bfloat16, float16 or null",
    ),
    "pin memory": (
        "train.py",
        ["loader.pin_memory=sometimes"],
        "loader.pin_memory=sometimes must be true, false or auto",
    ),
    "async save sometimes": (
        "train.py",
        ["checkpoint.async_save=sometimes"],
        "checkpoint.async_save=sometimes must be true, false or auto",
    ),
    "prefetch 0": (
        "train.py",
        ["loader.prefetch_factor=0"],
        "loader.prefetch_factor=0 must be an integer >= 1 or null",
    ),
    "cap big": (
        "train.py",
        ["data.max_per_device_batch_size=big"],
        "data.max_per_device_batch_size=big must be an integer >= 1, auto or null",
    ),
    "momentum 1": (
        "train.py",
        ["model.optimizer.momentum=1.0"],
        "model.optimizer.momentum=1.0 must be a number in [0, 1)",
    ),
    "betas": (
        "train.py",
        ["model/optimizer=adamw", "model.optimizer.betas=[0.9,1.5]"],
        "model.optimizer.betas=[0.9, 1.5] must be two numbers in [0, 1), e.g. [0.9, 0.999]",
    ),
    # the Trainer's arguments
    "devices 0": ("train.py", ["trainer.devices=0"], f"trainer.devices=0 must be {DEVICES}"),
    "devices abc": ("train.py", ["trainer.devices=abc"], f"trainer.devices=abc must be {DEVICES}"),
    "nodes abc": (
        "train.py",
        ["trainer.num_nodes=abc"],
        "trainer.num_nodes=abc must be an integer >= 1, or auto (the nodes torchrun, srun or the PyTorchJob started)",
    ),
    "accelerator": (
        "train.py",
        ["trainer.accelerator=tpu"],
        "trainer.accelerator=tpu must be one of auto, cpu, gpu, cuda",
    ),
    "precision": ("train.py", ["trainer.precision=17"], f"trainer.precision=17 must be one of {PRECISIONS}"),
    "sync batchnorm": (
        "train.py",
        ["trainer.sync_batchnorm=maybe"],
        "trainer.sync_batchnorm=maybe must be true, false, auto or null",
    ),
    "accumulation 0": (
        "train.py",
        ["trainer.accumulate_grad_batches=0"],
        "trainer.accumulate_grad_batches=0 must be an integer >= 1 or null",
    ),
    "max_steps 0": (
        "train.py",
        ["trainer.max_steps=0"],
        "trainer.max_steps=0 must be an integer >= 1 (or -1 for no limit); 0 would train nothing",
    ),
    "train share 1.5": (
        "train.py",
        ["trainer.limit_train_batches=1.5"],
        f"trainer.limit_train_batches=1.5 must be {EPOCH_SHARE}",
    ),
    "overfit abc": (
        "train.py",
        ["trainer.overfit_batches=abc"],
        "trainer.overfit_batches=abc must be an integer >= 0 or a number in [0, 1]",
    ),
    # ... and those passed to lightning.Trainer as they are: Lightning's own message, also in a dry run for more
    # devices than the machine has
    "max time": (
        "train.py",
        ["trainer.max_time=12h"],
        "trainer.max_time=12h: `Timer(duration='12h')` is not a valid duration. Expected a string in the format "
        "DD:HH:MM:SS.",
    ),
    "clip algorithm, dry run": (
        "train.py",
        ["trainer.gradient_clip_algorithm=max", "trainer.devices=8", "dry_run=true"],
        "trainer.gradient_clip_algorithm=max: `gradient_clip_algorithm` max is invalid. Allowed algorithms: "
        "['value', 'norm'].",
    ),
    # data and model keys, from their constructors' type hints: plain ones (int, float, Literal[...], tuple[...])...
    "width 1.5": ("train.py", ["model.net.width=1.5"], "model.net.width=1.5 must be an integer"),
    "unknown norm": ("train.py", ["model.net.norm=layer"], "model.net.norm=layer must be one of batch, group, none"),
    # ... and ranges, where a module's hints carry them (Annotated[int, Field(ge=1)])
    "ranged width 0": (
        "train.py",
        ["model.net._target_=user_modules.RangedCNN", "model.net.width=0"],
        "model.net.width=0 must be an integer >= 1",
    ),
    "ranged dropout 1": (
        "train.py",
        ["model.net._target_=user_modules.RangedCNN", "model.net.dropout=1.0"],
        "model.net.dropout=1.0 must be a number in [0, 1)",
    ),
    # a size the engine's split_lengths refuses, before anything is written
    "val size -1": (
        "train.py",
        ["data.val_size=-1"],
        "val_size=-1 must be >= 0: a count (>= 1), or a fraction (< 1) of 1797",
    ),
    "cifar val size, before the download": (
        "train.py",
        ["data=cifar10", "data.val_size=abc"],
        "data.val_size=abc must be a number",
    ),
    "synthetic shape": (
        "train.py",
        ["data=synthetic", "data.image_shape=[3,32]"],
        "data.image_shape=[3, 32] must be a list of 3 integers",
    ),
    "early stopping patience": (
        "train.py",
        ["callbacks=[default,early_stopping]", "callbacks.early_stopping.patience=abc"],
        "callbacks.early_stopping.patience=abc must be an integer",
    ),
    "two mistakes, one line": (
        "train.py",
        ["trainer.max_epochs=abc", "lr_schedule.gamma=0"],
        f"lr_schedule.gamma=0 must be a number > 0; trainer.max_epochs=abc must be {MAX_EPOCHS}",
    ),
    # eval.py and export.py
    "eval batch 0": (
        "eval.py",
        ["ckpt_path=nope.ckpt", "batch_size=0"],
        "batch_size=0 must be an integer >= 1 or null",
    ),
    "eval ckpt number": ("eval.py", ["ckpt_path=5"], "ckpt_path=5 must be a string"),
    "eval devices 0": ("eval.py", ["ckpt_path=nope.ckpt", "trainer.devices=0"], f"trainer.devices=0 must be {DEVICES}"),
    "eval precision": (
        "eval.py",
        ["ckpt_path=nope.ckpt", "trainer.precision=17"],
        f"trainer.precision=17 must be {PRECISIONS} or null",
    ),
    "eval workers": (
        "eval.py",
        ["ckpt_path=nope.ckpt", "+data.num_workers=-1"],
        "data.num_workers=-1 must be an integer >= 0",
    ),
    "export overwrite": (
        "export.py",
        ["ckpt_path=nope.ckpt", "overwrite=maybe"],
        "overwrite=maybe must be true or false",
    ),
    "export module": ("export.py", ["ckpt_path=nope.ckpt", "module=5"], "module=5 must be a string"),
    # Hydra's hint for an unknown key, followed: the template's own sections know their keys
    "added misspelled key": (
        "train.py",
        ["+trainer.max_epoch=1", "dry_run=true"],
        "trainer.max_epoch is not a key of trainer; did you mean trainer.max_epochs?",
    ),
    # ... and do not offer `+KEY=VALUE` there: it would be refused
    "misspelled devices": (
        "train.py",
        ["trainer.devics=2"],
        "trainer.devics is not a key of trainer; did you mean trainer.devices?",
    ),
    "eval trainer key": (
        "eval.py",
        ["ckpt_path=nope.ckpt", "+trainer.max_epochs=2"],
        "trainer.max_epochs is not a key of trainer",
    ),
    # a key of the other strategy, which this one would ignore, added or set
    "fsdp key added to ddp": ("train.py", ["+strategy.sharding=hybrid"], FSDP_KEY),
    "fsdp key set under ddp": ("train.py", ["strategy.sharding=hybrid"], FSDP_KEY),
    "ddp key set under fsdp": (
        "train.py",
        ["strategy=fsdp", "+strategy.static_graph=true"],
        "strategy.static_graph is a key of strategy=ddp, and this run has strategy.name=fsdp, which would ignore it: "
        "pass strategy=ddp strategy.static_graph=VALUE, or leave strategy.static_graph out",
    ),
    # a target that does not import, of the LightningModule or of a network it builds itself
    "model target that does not import": (
        "train.py",
        ["model._target_=nope.Nope"],
        "model._target_=nope.Nope does not import (No module named 'nope'): check the name, or install what it needs",
    ),
    "net target that does not import": (
        "train.py",
        ["model.net._target_=testbed.models.Nope", "dry_run=true"],
        "model.net._target_=testbed.models.Nope does not import (module 'testbed.models' has no "
        "attribute 'Nope'): check the name, or install what it needs",
    ),
    "shard class that does not import": (
        "train.py",
        ["strategy=fsdp", "strategy.shard_modules=[nope.Nope]", "trainer.accelerator=cpu", "trainer.devices=2"],
        "strategy.shard_modules: cannot import nope.Nope (No module named 'nope'); name its block classes (e.g. "
        "torchvision.models.resnet.BasicBlock), or null for every block of every network",
    ),
    # a config form that does not do what was meant: each names the form that does
    "data group removed": (
        "train.py",
        ["~data"],
        "data is missing from the config (~data removes it), and train.py needs it; choose one of its options: "
        "data=<option>",
    ),
    "model group removed": (
        "train.py",
        ["~model"],
        "model is missing from the config (~model removes it), and train.py needs it; choose one of its options: "
        "model=<option>",
    ),
    "key added that is there": (
        "train.py",
        ["+seed=1"],
        "+seed=1: seed is already in the config; set it with seed=1 (a leading + adds a new key)",
    ),
    "trainer key at the top level": (
        "train.py",
        ["+max_epochs=3"],
        "max_epochs=3 at the top level changes nothing: the key is trainer.max_epochs; pass trainer.max_epochs=3",
    ),
    "eval trainer key at the top level": (
        "eval.py",
        ["ckpt_path=nope.ckpt", "+devices=2"],
        "devices=2 at the top level changes nothing: the key is trainer.devices; pass trainer.devices=2",
    ),
    # directories a run writes into later, checked when it starts: not after an epoch, nor as a failed download
    "checkpoints into /proc": (
        "train.py",
        ["checkpoint.dirpath=/proc/nope"],
        "cannot write checkpoints into /proc/nope: No such file or directory; pass checkpoint.dirpath=<a directory "
        "you can write>",
    ),
    "data directory in /proc": (
        "train.py",
        ["paths.data_dir=/proc/nope", "data=cifar10"],
        "cannot create data.root=/proc/nope/cifar10 in paths.data_dir=/proc/nope: No such file or directory; pass "
        "paths.data_dir=<a directory you can write> (or data.root=<where the data is>)",
    ),
}
# A value that must work as typed: a share of each epoch, which the dry run plans as half the steps.
HALF_EPOCHS = ["train.py", ["trainer.limit_train_batches=0.5", "dry_run=true"]]


def case_run_dir(tmp: Path, name: str) -> Path:
    return tmp / "values" / name.replace(" ", "_").replace(",", "")


def overrides_in(run_dir: Path, script: str, overrides: list[str]) -> list[str]:
    """The case's overrides, with its own run directory, data directory (train) and export file (export)."""
    placed = {
        "train.py": [f"paths.data_dir={run_dir}/data"],
        "eval.py": [],
        "export.py": [f"output_path={run_dir}/net.pt"],
    }
    given = {arg.split("=", 1)[0] for arg in overrides}
    own = [arg for arg in placed[script] if arg.split("=", 1)[0] not in given]
    return [*own, *overrides, f"hydra.run.dir={run_dir}"]


BUGGY_INIT = "a bug in the user's __init__"  # not a mistake: exit 1 with its traceback
USERS_FILE = "a file the user's __init__ opens"  # the same: a path written in the user's code, not in the config


@pytest.fixture(scope="module")
def entry_point_results(paths) -> dict[str, tuple[dict[str, Any], Path]]:
    """Every entry-point case in one interpreter: each result ({rc, stdout, stderr}) with the case's run directory."""
    tmp = Path(paths["tmp"])
    (tmp / "existing").mkdir()
    (tmp / "existing" / "keep.txt").write_text("an earlier run's file")
    cases = {
        name: (script, [arg.format(**paths) for arg in args], None) for name, (script, args, _) in ENTRY_POINTS.items()
    }
    for name, module in ((BUGGY_INIT, "BuggyClassifier"), (USERS_FILE, "HardCodedPathClassifier")):
        cases[name] = ("train.py", [*QUIET, f"model._target_=user_modules.{module}", f"hydra.run.dir={tmp}/bug"], None)
    for name, (script, args, _) in {**WRONG_VALUES, "half epochs": (*HALF_EPOCHS, "")}.items():
        run_dir = case_run_dir(tmp, name)
        cases[name] = (script, overrides_in(run_dir, script, args), run_dir)
    (tmp / "cases.json").write_text(json.dumps([[script, args] for script, args, _ in cases.values()]))
    driver = [sys.executable, str(TESTS / "entry_point_cases.py"), str(tmp / "cases.json"), str(tmp / "results.json")]
    check(run_command(driver, timeout=600))
    results = json.loads((tmp / "results.json").read_text())
    return {name: (result, run_dir) for (name, (_, _, run_dir)), result in zip(cases.items(), results, strict=True)}


@pytest.mark.slow
@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_entry_point_exits_2_with_one_line(name, entry_point_results):
    result, _ = entry_point_results[name]
    assert result["rc"] == EXIT_USER_ERROR, result["stderr"][-3000:]
    assert "Traceback" not in result["stderr"] and "HYDRA_FULL_ERROR" not in result["stderr"]
    assert result["stderr"].strip().splitlines()[-1] == ENTRY_POINTS[name][2]


@pytest.mark.slow
def test_a_refused_run_keeps_the_directory_it_was_given(entry_point_results, paths):
    assert (Path(paths["tmp"]) / "existing" / "keep.txt").read_text() == "an earlier run's file"


@pytest.mark.slow
def test_a_sweep_refuses_before_its_first_job_starts(entry_point_results, paths):
    assert not (Path(paths["tmp"]) / "sweep").exists() and not (Path(paths["tmp"]) / "sweep_models").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", WRONG_VALUES)
def test_wrong_value_is_one_line_before_anything_starts(name, entry_point_results):
    result, run_dir = entry_point_results[name]
    output = result["stdout"] + result["stderr"]
    assert result["rc"] == EXIT_USER_ERROR, output[-3000:]
    assert "Traceback" not in output
    assert [line for line in output.splitlines() if line.startswith("error:")] == [f"error: {WRONG_VALUES[name][2]}"]
    assert "][ERROR] - " not in output  # no log line saying it again
    # No run directory: no plan, config, checkpoint, data (paths.data_dir points there) or export, not even Hydra's
    # .hydra/ and an empty log.
    assert not run_dir.exists()


@pytest.mark.slow
def test_a_share_of_each_epoch_works_as_typed(entry_point_results):
    result, run_dir = entry_point_results["half epochs"]
    assert result["rc"] == 0, result["stderr"][-3000:]
    plan = json.loads((run_dir / "plan.json").read_text())
    # 1257 training samples fill 19 global batches of 64; half of them, rounded down, in each of the 12 epochs.
    assert (plan["steps_per_epoch"], plan["total_steps"], plan["epoch_limit_flag"], plan["epoch_limit_value"]) == (
        9,
        108,
        "limit_train_batches",
        0.5,
    )


class Colour(Enum):
    red = "red"
    blue = "blue"


class Widget:
    """A user's own class, for the constructor checks: hints with and without ranges, types YAML cannot write (a
    path, a tuple, an enum), and hints that cannot be checked (a tensor) or need not be (none)."""

    def __init__(
        self,
        fast: bool = False,
        colour: Colour = Colour.red,
        size: Annotated[int, Field(ge=1)] = 1,
        scale: Annotated[float, Field(gt=0, le=10)] = 1.0,
        root: Path = Path("."),
        pair: tuple[float, float] = (0.0, 1.0),
        weights: torch.Tensor | None = None,
        anything=None,
        mode: str = "fast",
    ) -> None:
        pass


@pytest.fixture(scope="module")
def complete(tmp_path_factory) -> Callable[[dict[str, Any], str], dict[str, Any]]:
    """`complete(config, job)`: `config` with each section the engine reads alone (trainer, lr_schedule, strategy,
    ...) filled in from the job's composed config, the test's keys on top: the section as a run has it, where every
    key must be there (config/schema.py)."""
    from scaleup.config.plain import to_plain
    from scaleup.config.schema import SECTIONS
    from scaleup.testing import compose

    full = {
        job: to_plain(compose(job, [f"hydra.run.dir={tmp_path_factory.mktemp(job)}", "ckpt_path=x.ckpt"], ROOT))
        for job in ("train", "eval")
    }

    def fill(config: dict[str, Any], job: str) -> dict[str, Any]:
        given = [name for name, schema in SECTIONS[job].items() if schema.closed and isinstance(config.get(name), dict)]
        return {**config, **{name: {**full[job][name], **config[name]} for name in given}}

    return fill


@pytest.mark.parametrize(
    ("config", "job", "message"),
    [
        ({"trainer": {"max_epochs": "abc"}}, "train", f"trainer.max_epochs=abc must be {MAX_EPOCHS}"),
        ({"lr_schedule": {"base_batch_size": 0}}, "train", "lr_schedule.base_batch_size=0 must be an integer >= 1"),
        ({"data": {"global_batch_size": 8.0}}, "train", "data.global_batch_size=8.0 must be an integer >= 1 or null"),
        ({"data": {"num_workers": True}}, "train", "data.num_workers=true must be an integer >= 0"),
        ({"trainer": {"devices": "3"}}, "train", f"trainer.devices=3 must be {DEVICES}"),
        ({"model": {"optimizer": {"lr": "1e-3"}}}, "train", "model.optimizer.lr=1e-3 must be a number > 0"),
        (
            {"lr_schedule": None, "monitor": "val/acc"},
            "train",
            "monitor=val/acc must be a mapping of keys (one per line in its YAML file)",
        ),
        (
            {"data": {"max_per_device_batch_size": 0}},
            "train",
            "data.max_per_device_batch_size=0 must be an integer >= 1, auto or null",
        ),
        (
            {"batch_size": -1, "trainer": {"precision": "17"}},
            "eval",
            f"batch_size=-1 must be an integer >= 1 or null; trainer.precision=17 must be {PRECISIONS} or null",
        ),
        ({"overwrite": "no"}, "export", "overwrite=no must be true or false"),
        ({"output_path": 5, "module": None}, "export", "output_path=5 must be a string; module=null must be a string"),
        (
            {"compile": 1, "trainer": {"num_nodes": 0, "enable_progress_bar": None}},
            "eval",
            "compile=1 must be true or false; trainer.num_nodes=0 must be an integer >= 1; "
            "trainer.enable_progress_bar=null must be true or false",
        ),
        ({"seed": 2**32}, "train", "seed=4294967296 must be an integer in [0, 4294967295]"),
        (
            {"checkpoint": {"every_n_train_steps": 0}},
            "train",
            "checkpoint.every_n_train_steps=0 must be an integer >= 1 or null",
        ),
        (
            {"lr_schedule": {"base_bn_batch_size": 0, "warmup_steps": 1.5}},
            "train",
            "lr_schedule.base_bn_batch_size=0 "
            "must be an integer >= 1 or null; lr_schedule.warmup_steps=1.5 must be an integer >= 0 or null",
        ),
        (
            {"strategy": {"timeout_minutes": 0, "find_unused_parameters": 2}},
            "train",
            "strategy.timeout_minutes=0 must be a number > 0; strategy.find_unused_parameters=2 must be true or false",
        ),
        ({"loader": {"persistent_workers": 1}}, "train", "loader.persistent_workers=1 must be true or false"),
        (
            {"data": {"per_device_batch_size": 0}},
            "train",
            "data.per_device_batch_size=0 must be an integer >= 1 or null",
        ),
        (
            {"model": {"optimizer": {"_target_": "torch.optim.SGD", "weight_decay": -0.1, "nesterov": "maybe"}}},
            "train",
            "model.optimizer.weight_decay=-0.1 must be a number >= 0; "
            "model.optimizer.nesterov=maybe must be true or false",
        ),
        (
            {
                "trainer": {
                    "log_every_n_steps": 0,
                    "limit_train_batches": 0,
                    "fast_dev_run": -1,
                    "gradient_clip_val": -1,
                }
            },
            "train",
            f"trainer.log_every_n_steps=0 must be an integer >= 1, auto or null; trainer.limit_train_batches=0 must be "
            f"{EPOCH_SHARE}; trainer.fast_dev_run=-1 must be true, false or an integer >= 0; "
            "trainer.gradient_clip_val=-1 must be a number >= 0 or null (below 0 the clipping would turn the gradients "
            "around)",
        ),
        (
            {"trainer": {"enable_progress_bar": "abc"}},
            "train",
            "trainer.enable_progress_bar=abc must be true, false or null",
        ),
        (
            {
                "model": {
                    "_target_": "testbed.models.ImageClassifier",
                    "label_smoothing": "abc",
                    "net": {"_target_": "testbed.models.resnet", "small_input": 3, "num_classes": None},
                }
            },
            "train",
            "model.label_smoothing=abc must be a number; model.net.small_input=3 must be true or false",
        ),
        (
            {"model": {"net": {"_target_": "testbed.models.DigitsCNN", "dropout": "abc", "width": 1.5}}},
            "train",
            "model.net.width=1.5 must be an integer; model.net.dropout=abc must be a number",
        ),
        (
            {
                "callbacks": {"ema": {"_target_": "scaleup.callbacks.ema.EMA", "decay": "abc"}},
                "logger": {"tb": {"_target_": "lightning.pytorch.loggers.TensorBoardLogger", "default_hp_metric": 3}},
            },
            "train",
            "callbacks.ema.decay=abc must be a number; logger.tb.default_hp_metric=3 must be true or false",
        ),
        (
            {"data": {"_target_": "testbed.data.SyntheticDataModule", "train_size": 1.5, "val_size": "abc"}},
            "train",
            "data.train_size=1.5 must be an integer; data.val_size=abc must be an integer",
        ),
        (
            {
                "model": {
                    "_target_": f"{__name__}.Widget",
                    "size": 0,
                    "scale": 11,
                    "root": 3,
                    "pair": [1, "x"],
                    "mode": 2,
                }
            },
            "train",
            "model.size=0 must be an integer >= 1; model.scale=11 must be a number in (0, 10]; model.root=3 must be a "
            "path; model.pair=[1, x] must be a list of 2 numbers; model.mode=2 must be a string",
        ),
        (
            # lax conversions stay refused: a string read as a number or a boolean, a float as an integer
            {"model": {"_target_": f"{__name__}.Widget", "size": "5", "fast": "yes", "pair": [1.0, True]}},
            "train",
            "model.fast=yes must be true or false; model.size=5 must be an integer >= 1; model.pair=[1.0, true] must "
            "be a list of 2 numbers",
        ),
        (
            {"model": {"_target_": f"{__name__}.Widget", "size": 2.0, "colour": "green"}},
            "train",
            "model.colour=green must be one of red, blue; model.size=2.0 must be an integer >= 1",
        ),
        (
            {"lr_schedule": {"warmup_epoch": 2}, "strategy": {"mixed_precison": "bfloat16"}, "loader": {"x": 1}},
            "train",
            "loader.x is not a key of loader; lr_schedule.warmup_epoch is not a key of lr_schedule; did you mean "
            "lr_schedule.warmup_epochs?; strategy.mixed_precison is not a key of strategy; did you mean "
            "strategy.mixed_precision?",
        ),
        ({"strategy": {"name": "ddp", "sharding": "hybrid"}}, "train", FSDP_KEY),
        (  # Lightning takes both: 0 divides by zero at the first epoch's end, maybe is taken as true
            {"trainer": {"check_val_every_n_epoch": 0, "deterministic": "maybe"}},
            "train",
            "trainer.check_val_every_n_epoch=0 must be an integer >= 1 (validate every N epochs) or null (with an "
            "integer val_check_interval: every N batches across epochs); trainer.deterministic=maybe must be true, "
            "false, warn or null",
        ),
        (  # a target that does not import: its arguments are not checked
            {"model": {"_target_": "no.such.module.Model", "width": "abc"}},
            "train",
            "model._target_=no.such.module.Model does not import (No module named 'no'): check the name, or install "
            "what it needs",
        ),
    ],
)
def test_schema_messages(config, job, message, complete):
    with pytest.raises(UserError) as raised:
        validate_config(complete(config, job), job)
    assert str(raised.value) == message


def test_an_init_group_of_your_own_without_the_engines_target_is_one_line(complete):
    """init's option names the part that does its keys (`_target_: scaleup.finetune.prepare_start`): a group of the
    user's own that leaves it out is told to start from the engine's option."""
    config = complete({"init": {}}, "train")
    del config["init"]["_target_"]
    with pytest.raises(UserError) as raised:
        validate_config(config, "train")
    assert str(raised.value).startswith("init._target_ is missing: the engine's init options set it; start a group")


@pytest.mark.parametrize(
    ("config", "override", "message"),
    [
        (  # the Trainer argument the template sets itself: where the setting lives, not the same key again
            {"trainer": {"strategy": "ddp_spawn"}},
            "+trainer.strategy=ddp_spawn",
            "trainer.strategy is set by the template, not in trainer: choose it with strategy.name=VALUE (ddp, "
            "ddp_spawn or fsdp; strategy=fsdp for FSDP's own keys)",
        ),
        (
            {"trainer": {"callbacks": []}},
            "+trainer.callbacks=[]",
            "trainer.callbacks is set by the template, not in trainer: yours are the callbacks group's "
            "(callbacks=[default,early_stopping], or +callbacks.<name>={_target_: ...}), the template adds its own",
        ),
        (  # Hydra takes + over a null, refuses it over a value: both are refused alike
            {"trainer": {"limit_train_batches": 0.5}},
            "+trainer.limit_train_batches=0.5",
            "+trainer.limit_train_batches=0.5: trainer.limit_train_batches is already in the config; set it with "
            "trainer.limit_train_batches=0.5 (a leading + adds a new key)",
        ),
        (
            {"ckpt_path": "x.ckpt"},
            "+ckpt_path=x.ckpt",
            "+ckpt_path=x.ckpt: ckpt_path is already in the config; set it with ckpt_path=x.ckpt (a leading + adds a "
            "new key)",
        ),
        (  # a top-level key that nothing reads, as a known name at the top level is (+lr=0.5)
            {"warmup_epoch": 1, "lr_schedule": {}},
            "+warmup_epoch=1",
            "+warmup_epoch=1: nothing reads a top-level warmup_epoch; did you mean lr_schedule.warmup_epochs? (a key "
            "of your own belongs in your configs/train.yaml)",
        ),
    ],
)
def test_a_key_added_with_plus_is_refused_where_it_adds_nothing(config, override, message, complete):
    with pytest.raises(UserError) as raised:
        validate_config(complete(config, "train"), "train", [override])
    assert str(raised.value) == message


def test_a_key_of_your_own_added_with_plus_passes(complete):
    """A new key in a section that passes keys on (data, model), and a group chosen with + (an experiment)."""
    config = complete({"data": {"anything": 1}, "model": {"net": {"depth": 3}}}, "train")
    validate_config(config, "train", ["+data.anything=1", "+experiment=goyal_imagenet", "++trainer.max_epochs=2"])


ACCEPTED = [
    *({"trainer": {"devices": devices}} for devices in (1, 8, -1, "-1", "auto", [0, 1], "0,1", "3,")),
    *({"trainer": {"precision": precision}} for precision in ("auto", "64-true", 16, "bf16-mixed")),
    {"trainer": {"max_epochs": -1, "max_steps": 100, "limit_train_batches": 0.5, "limit_val_batches": 0}},
    {"trainer": {"max_time": "00:12:00:00", "val_check_interval": {"minutes": 30}, "fast_dev_run": True}},
    # a string for a Path, a list for a tuple, a tensor and an argument without a hint unchecked
    {"model": {"_target_": f"{__name__}.Widget", "root": "data", "pair": [0, 0.5], "weights": [1], "anything": 1}},
    {"model": {"_target_": f"{__name__}.Widget", "colour": "blue", "fast": True, "scale": 10}},
    # null (the data fills it in) and what Hydra builds pass
    {"model": {"_target_": f"{__name__}.Widget", "size": None, "scale": {"_target_": "math.sqrt"}}},
    # a Trainer argument the schema does not check, and the data module's own arguments
    {"trainer": {"benchmark": True}, "data": {"anything": 1}},
]


@pytest.mark.parametrize("config", ACCEPTED)
def test_schema_accepts(config, complete):
    validate_config(complete(config, "train"))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"limit_val_batches": -1},
            "trainer.limit_val_batches=-1: You have passed invalid value -1 for limit_val_batches, it has to be in "
            "[0.0, 1.0] or an int.",
        ),
        (
            {"val_check_interval": 0.5, "max_time": {"hourz": 1}},
            "trainer.max_time={hourz: 1}: 'hourz' is an invalid keyword argument for __new__()",
        ),
        (  # Lightning takes it, and stops at max_epochs
            {"min_epochs": 20, "max_epochs": 12},
            "trainer.min_epochs=20 is above trainer.max_epochs=12, which would stop the run first: lower "
            "trainer.min_epochs or raise trainer.max_epochs",
        ),
        (
            {"min_steps": 10, "max_steps": 5},
            "trainer.min_steps=10 is above trainer.max_steps=5, which would stop the run first: lower "
            "trainer.min_steps or raise trainer.max_steps",
        ),
        (  # refused together only: the message names both
            {"barebones": True},
            "trainer: `Trainer(barebones=True, enable_progress_bar=True)` was passed. The progress bar can impact raw "
            "speed so it is disabled in barebones mode.",
        ),
    ],
)
def test_a_trainer_value_lightning_refuses_is_its_message_in_one_line(values, message):
    """The `trainer.*` keys the engine does not read pass to lightning.Trainer as they are: Lightning's own check,
    run before anything is built, names the key it refuses."""
    with pytest.raises(UserError) as raised:
        check_trainer_arguments(engine_section("trainer/default", **values))
    assert str(raised.value) == message


def test_a_run_composes_its_config_as_hydra_does_and_no_more(monkeypatch, tmp_path):
    """`python train.py` leaves the composition to Hydra: a mistake in the overrides is one line from Hydra's own
    composition (run through Hydra's steps, which raise), not from composing the config once before it; and no
    environment variable carries the engine's choice."""
    import scaleup.train
    from scaleup.config import project

    composed, seen = [], []
    compose, train = project.compose_project, scaleup.train.train
    monkeypatch.setattr(
        project, "compose_project", lambda *args, **kwargs: composed.append(args) or compose(*args, **kwargs)
    )
    monkeypatch.setattr(
        scaleup.train, "train", lambda cfg: seen.append(os.environ.get("HYDRA_FULL_ERROR")) or train(cfg)
    )
    overrides = ["dry_run=true", f"paths.data_dir={tmp_path}/data", f"hydra.run.dir={tmp_path}/run"]
    monkeypatch.setattr(sys, "argv", [str(ROOT / "train.py"), *overrides])
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    assert composed == [] and (tmp_path / "run" / "plan.json").exists()
    # The job, and the processes it starts, see no HYDRA_FULL_ERROR the user did not set.
    assert seen == [None] and "HYDRA_FULL_ERROR" not in os.environ


@pytest.mark.slow  # the entry points' interpreter
def test_a_bug_in_the_users_init_keeps_its_traceback(entry_point_results):
    """A TypeError raised inside the user's LightningModule.__init__ is a bug in their code, not a config mistake:
    the traceback shows their file and line (an unknown argument in the config is still one line, by signature)."""
    bug = line_of("# the bug")
    failed, _ = entry_point_results[BUGGY_INIT]
    assert failed["rc"] == 1 and "error: model:" not in failed["stderr"]
    assert f'user_modules.py", line {bug}, in __init__' in failed["stderr"]
    assert "TypeError: empty(): argument 'size' (position 1) must be tuple of ints" in failed["stderr"]


def line_of(marker: str) -> int:
    """The line of user_modules.py that ends with `marker`."""
    source = (TESTS / "user_modules.py").read_text().splitlines()
    return next(number for number, line in enumerate(source, 1) if line.endswith(marker))


@pytest.mark.slow  # the entry points' interpreter
def test_a_file_the_users_code_opens_keeps_its_traceback(entry_point_results):
    """An OSError naming a file is a config mistake only where the file is a value of the config and the engine or a
    library met it: a path written in the user's own __init__ is a bug there, shown with its file and line."""
    failed, _ = entry_point_results[USERS_FILE]
    assert failed["rc"] == 1 and "error:" not in failed["stderr"]
    assert f'user_modules.py", line {line_of("# the missing file")}, in __init__' in failed["stderr"]
    assert "FileNotFoundError: [Errno 2] No such file or directory: '/nonexistent/class_names.txt'" in failed["stderr"]


def test_a_file_error_is_the_users_mistake_only_for_a_path_of_the_config(tmp_path):
    """Where the engine meets a missing file, the one-line message is for a path the config gave (or a folder above
    one); any other file is the engine's own and keeps its traceback."""
    from scaleup.errors import as_user_error

    missing = tmp_path / "nope" / "net.pt"
    try:
        missing.open()
    except OSError as err:
        raised = err
    raised.__traceback__ = None  # as if met in installed code: no frame of this file
    assert "check that path" in str(as_user_error(raised, given=["abc", str(missing)]))
    assert "check that path" in str(as_user_error(raised, given=[str(missing / "below")]))
    assert as_user_error(raised, given=["abc", str(tmp_path / "other")]) is None


def test_an_engine_bug_in_a_config_section_keeps_its_traceback():
    """A ValueError raised by the engine's own code while a section is built is a bug, not `data: <message>`: the
    config's values were checked before the call (here an engine class that refuses its argument itself)."""
    from scaleup.build import build_datamodule

    data = {"_target_": "scaleup.data.permutation.FeistelPermutation", "n": 0, "seed": 0, "epoch": 0}
    with pytest.raises(Exception) as raised:
        build_datamodule(data, {}, seed=0)
    assert as_user_error(raised.value) is None


def test_a_mistake_under_torchrun_is_one_line_printed_once_and_exit_2(tmp_path, monkeypatch, capsys):
    """Every torchrun worker finds the same mistake: rank 0 prints it, each rank records it for torchrun's agent, and
    the engine's wrapper (distributed/torchrun.py) exits 2 adding only another rank's line that differs."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from scaleup.distributed.torchrun import mistakes_unsaid
    from scaleup.errors import exit_on_user_error

    def job(message: str) -> Callable[[], None]:
        def refuse() -> None:
            raise UserError(message)

        return exit_on_user_error(refuse)

    def worker(rank: int, message: str) -> ProcessFailure:
        error_file = tmp_path / f"rank{rank}" / "error.json"
        error_file.parent.mkdir(exist_ok=True)
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        with pytest.raises(SystemExit) as exited:
            job(message)()
        assert exited.value.code == EXIT_USER_ERROR
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=EXIT_USER_ERROR, error_file=str(error_file))

    same = {rank: worker(rank, "seed=-5 must be an integer in [0, 4294967295]") for rank in (0, 1)}
    assert capsys.readouterr().err == "error: seed=-5 must be an integer in [0, 4294967295]\n"  # rank 0's, once
    assert mistakes_unsaid(ChildFailedError("train.py", same)) == []
    other = {0: same[0], 1: worker(1, "data: rank 1's shard is unreadable")}
    assert mistakes_unsaid(ChildFailedError("train.py", other)) == ["error: data: rank 1's shard is unreadable"]
    crashed = {0: same[0], 1: ProcessFailure(local_rank=1, pid=101, exitcode=1, error_file="")}
    assert mistakes_unsaid(ChildFailedError("train.py", crashed)) is None  # a bug somewhere: torchrun's summary


def test_the_torchrun_wrapper_names_the_rank_that_raised_as_the_root_cause(tmp_path, monkeypatch):
    """Rank 1 raised and recorded its error (the watchdog's record, for torchrun's agent); rank 0 stopped because of
    it, within the same second: torchrun's summary names rank 1, not the first rank of the tie."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from scaleup.distributed.torchrun import root_cause_first
    from scaleup.errors import record_for_launcher

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "rank1.json"))
    assert record_for_launcher("rank 1 (pid 101) failed at step 5:\nValueError: rank 1 cannot go on")
    failures = {
        0: ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file=str(tmp_path / "rank0.json")),
        1: ProcessFailure(local_rank=1, pid=101, exitcode=1, error_file=str(tmp_path / "rank1.json")),
    }
    failures[0].timestamp = failures[1].timestamp  # stopped within the same second
    named = root_cause_first(ChildFailedError("train.py", failures))
    assert named.get_first_failure()[0] == 1 and "ValueError: rank 1 cannot go on" in named.format_msg()
    assert sorted(named.failures) == [0, 1]
