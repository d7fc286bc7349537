"""Every user mistake ends in one message naming the fix and exit code 2, never a traceback.

The matrix runs each job in this process, with the config composed from the same overrides a user would type, and
turns what it raises into the message the entry point would print (`as_user_error`, what `exit_on_user_error` uses).
A handful of cases run the real entry points, to check the exit code, the last line of stderr and that no traceback
is printed; they run at the same time, in one fixture.
"""

import subprocess
import sys

import pytest
import torch

from conftest import ROOT, clean_env, in_process
from scaleup.engine.errors import EXIT_USER_ERROR, as_user_error
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
    torch.save({"net.0.weight": torch.zeros(1)}, tmp / "state_dict.pt")
    (tmp / "exists.pt").write_bytes(b"")
    (tmp / "empty").mkdir()
    return {"tmp": str(tmp), "ckpt": str(ckpt)}


# (id, job, overrides, a piece of the expected message). {tmp} and {ckpt} are filled in from `paths`.
CASES = [
    # config values
    ("negative lr", "train", ["model.optimizer.lr=-1", "dry_run=true"], "model.optimizer: Invalid learning rate: -1"),
    ("zero global batch", "train", ["data.global_batch_size=0"], "data.global_batch_size=0 must be at least 1"),
    ("unknown norm", "train", ["model.net.norm=layer"], "model: norm='layer' is not one of batch, group, none"),
    ("unknown net argument", "train", ["+model.net.depth=3"], "unexpected keyword argument 'depth'"),
    (
        "unknown data argument",
        "train",
        ["+data.colour=red"],
        "data: GlobalBatchDataModule.__init__() got an unexpected keyword argument 'colour'",
    ),
    (
        "indivisible batch",
        "train",
        ["data.global_batch_size=100", "trainer.accelerator=cpu", "trainer.devices=3", "dry_run=true"],
        "data.global_batch_size=100 does not divide into 3 device(s)",
    ),
    ("both batch sizes", "train", ["data.per_device_batch_size=8"], "set exactly one of data.global_batch_size"),
    ("batch above data", "train", ["data.global_batch_size=4096"], "larger than the training set (1257 samples)"),
    ("no training data", "train", ["data.val_size=1500"], "leave no training data out of 1797"),
    ("scaling rule", "train", ["lr_schedule.rule=cubic"], "rule=cubic is not one of linear, sqrt, none"),
    ("decay", "train", ["lr_schedule.decay=exp"], "decay=exp is not one of cosine, step, none"),
    ("two warmups", "train", ["lr_schedule.warmup_steps=5"], "warmup_epochs or lr_schedule.warm"),
    ("accumulation 0", "train", ["trainer.accumulate_grad_batches=0"], "accumulate_grad_batches=0 must be at least"),
    ("shuffle", "train", ["+data.shuffle=true"], "remove data.shuffle"),
    ("tiny limit", "train", ["+trainer.limit_train_batches=0.01"], "limit_train_batches=0.01 keeps less than one"),
    (
        "bad interpolation",
        "train",
        ["data.num_workers=${{nowhere}}"],
        "the config does not resolve (at data.num_workers): Interpolation key 'nowhere' not found",
    ),
    ("trainer precision", "train", ["trainer.precision=17", *QUIET], "trainer: Precision '17' is invalid"),
    ("trainer argument", "train", ["+trainer.colour=red", *QUIET], "trainer: Trainer.__init__() got an unexpected"),
    # devices
    ("zero devices", "train", ["trainer.devices=0"], "trainer.devices=0 and trainer.num_nodes=1 must both be at"),
    ("accelerator", "train", ["trainer.accelerator=tpu"], "trainer.accelerator=tpu is not supported here"),
    ("fp16 on cpu", "train", ["trainer.precision=16-mixed", "trainer.accelerator=cpu"], "16-mixed needs a GPU"),
    (
        "syncbn on cpu",
        "train",
        ["trainer.sync_batchnorm=true", "trainer.accelerator=cpu", "trainer.devices=2", "dry_run=true"],
        "trainer.sync_batchnorm=true cannot run on CPU",
    ),
    (
        "fsdp on cpu",
        "train",
        ["strategy=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "dry_run=true"],
        "strategy=fsdp needs GPUs",
    ),
    # data
    ("missing image tree", "train", ["data=imagefolder", "data.root={tmp}/none"], "no train/ directory under"),
    (
        "cifar without download",
        "train",
        ["data=cifar10", "data.root={tmp}/empty", "data.download=false"],
        "CIFAR-10 is not under",
    ),
    (
        "archive unreachable",
        "train",
        ["data=imagefolder", "data.root={tmp}/imgs", "data.url=http://127.0.0.1:9/imgs.tgz"],
        "could not download data.url=http://127.0.0.1:9/imgs.tgz",
    ),
    # checkpoints
    ("missing checkpoint", "train", ["ckpt_path={tmp}/nope.ckpt"], "checkpoint {tmp}/nope.ckpt does not exist"),
    ("another network", "train", ["ckpt_path={ckpt}"], "was trained with another network: model.net.width=8 (now"),
    (
        "finished checkpoint",
        "train",
        ["ckpt_path={ckpt}", "model.net.width=8", *TINY_RUN],
        "already at or past this plan's 4 steps",
    ),
    ("eval without checkpoint", "eval", [], "ckpt_path has no value (it is ??? in the config): pass ckpt_path="),
    ("truncated checkpoint", "eval", ["ckpt_path={tmp}/truncated.ckpt"], "is not a readable checkpoint"),
    ("foreign checkpoint", "eval", ["ckpt_path={tmp}/state_dict.pt"], "was not written by this template's train.py"),
    ("eval precision", "eval", ["ckpt_path={ckpt}", "trainer.precision=17"], "trainer: Precision '17' is invalid"),
    # output locations
    (
        "export into /proc",
        "export",
        ["ckpt_path={ckpt}", "output_path=/proc/nope/net.pt"],
        "/proc/nope: No such file or directory; check that path",
    ),
    ("export over a file", "export", ["ckpt_path={ckpt}", "output_path={tmp}/exists.pt"], "exists.pt already exists"),
    (
        "checkpoints into /proc",
        "train",
        [*TINY_RUN, *QUIET, "checkpoint.dirpath=/proc/nope"],
        "/proc/nope: No such file or directory",
    ),
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
    assert "torchrun started 4 process(es) but trainer.devices x trainer.num_nodes = 2 x 1 = 2" in str(
        as_user_error(raised.value)
    )


def test_offline_download_is_one_clear_message(tmp_path, monkeypatch):
    # A closed local port as the proxy: the same failure as a machine with no network, but instant.
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    with pytest.raises(Exception) as raised:
        in_process(["data=cifar10", f"data.root={tmp_path}/cifar", f"hydra.run.dir={tmp_path}"])
    assert "could not download CIFAR-10 into" in str(as_user_error(raised.value))


# (script, overrides, the last line of stderr)
ENTRY_POINTS = {
    "eval without checkpoint": (
        "eval.py",
        ["hydra.run.dir={tmp}/eval"],
        "error: ckpt_path has no value (it is ??? in the config): pass ckpt_path=<value>",
    ),
    "negative lr": (
        "train.py",
        ["model.optimizer.lr=-1", "dry_run=true", "hydra.run.dir={tmp}/lr"],
        "error: model.optimizer: Invalid learning rate: -1",
    ),
    "unknown norm": (
        "train.py",
        ["model.net.norm=layer", "dry_run=true", "hydra.run.dir={tmp}/norm"],
        "error: model: norm='layer' is not one of batch, group, none",
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
}


@pytest.fixture(scope="module")
def entry_point_results(paths) -> dict[str, subprocess.CompletedProcess]:
    """All entry-point cases at once: their interpreters start in parallel."""
    procs = {
        name: subprocess.Popen(
            [sys.executable, script, *(arg.format(**paths) for arg in args)],
            cwd=ROOT,
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (script, args, _) in ENTRY_POINTS.items()
    }
    return {name: subprocess.CompletedProcess(p.args, p.wait(120), *p.communicate()) for name, p in procs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_entry_point_exits_2_with_one_line(name, entry_point_results):
    result = entry_point_results[name]
    assert result.returncode == EXIT_USER_ERROR, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "HYDRA_FULL_ERROR" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == ENTRY_POINTS[name][2]
