"""Ray Train (`python -m scaleup.distributed.ray_train`): a local Ray cluster, started once for this file, runs the
float64 recipe on 2 workers; one worker is killed with SIGKILL mid-run, Ray restarts the worker group, which resumes
from the run directory's last checkpoint and ends with the uninterrupted 1-process run's weights. The plan is made
for Ray's world size, a dry run starts no Ray, and a job that cannot start is one line and exit code 2. The KubeRay
RayJob manifest validates against KubeRay's CRD schema.
"""

import importlib.util
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_launchers import free_port

from conftest import (
    EXACT,
    EXACT_TEST,
    EXACT_VAL,
    ROOT,
    TOLERANCE,
    assert_same_weights,
    clean_env,
    merged,
    read_json,
    start,
    weights,
)
from kubeflow_operators import load, validation_errors

DEPLOY = ROOT / "deploy" / "kubernetes"
RAY_TRAIN = [sys.executable, "-m", "scaleup.distributed.ray_train"]
# The test cluster listens on this machine only: no token (Ray would keep one under ~/.ray for its clients). Its
# one node is never pre-empted: no actor of Ray Train's own watching for that (a process of its own per run).
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


def ray_train(args: list[str], log: Path) -> subprocess.Popen:
    """The Ray entry point as a user runs it, from the repository; its output (the driver's, and the workers' that
    Ray forwards to it) in `log`."""
    return start([*RAY_TRAIN, *merged(args)], env=clean_env(**RAY_ENV), log=log)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """One local Ray cluster for this file (`ray start --head --block`, stopped with it): 2 CPUs, no dashboard,
    its files under a temporary directory (a short path: Ray's sockets live there). Yields its address."""
    if importlib.util.find_spec("ray") is None:  # not imported here: the dry run shows it needs no Ray
        pytest.skip("Ray is not installed (pip install -e '.[ray]')")
    temp = Path(tempfile.mkdtemp(prefix="ray"))
    port = free_port()
    command = [
        *(sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--num-cpus=2"),
        *("--node-ip-address=127.0.0.1", f"--port={port}", f"--temp-dir={temp}"),
        *("--include-dashboard=false", "--disable-usage-stats"),
    ]
    with (temp / "head.log").open("w") as out:
        # No drain on SIGTERM: nothing runs on the cluster when the tests stop it.
        env = clean_env(**RAY_ENV, RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")
        head = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:  # stopped also when it does not start in time: no cluster is left running
        deadline = time.monotonic() + 300  # about 10 s on a quiet machine
        while "Ray runtime started" not in (temp / "head.log").read_text():
            assert head.poll() is None and time.monotonic() < deadline, (temp / "head.log").read_text()
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        head.send_signal(signal.SIGTERM)  # --block: stops every process of the cluster
        head.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def entry_point(capsys, tmp_path) -> Iterator:
    """`main(args)` of the entry point in this process, for what it does before Ray starts: (exit code, stderr
    lines). Hydra's global state and the logging a dry run sets up are left as they were found."""
    from hydra.core.hydra_config import HydraConfig

    from scaleup.distributed.ray_train import main

    def call(args: list[str]) -> tuple[int, list[str]]:
        code = main([*args, f"hydra.run.dir={tmp_path / 'run'}"])
        return code, capsys.readouterr().err.strip().splitlines()

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield call
    HydraConfig.instance().cfg = None
    for handler in set(root.handlers) - set(handlers):
        handler.close()
    root.handlers[:], root.level = handlers, level


def test_dry_run_plans_for_rays_world_size_without_ray(entry_point, monkeypatch, tmp_path):
    """4 GPU workers, planned on this machine where Ray cannot be imported: the per-device batch, LR and SyncBN of 4
    devices, in plan.json."""
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails, as where Ray is not installed
    assert entry_point(["num_workers=4", "use_gpu=true", "dry_run=true"]) == (0, [])
    plan = read_json(tmp_path / "run" / "plan.json")
    assert (plan["world_size"], plan["per_device_batch_size"], plan["accumulate_grad_batches"]) == (4, 16, 1)
    assert (plan["accelerator"], plan["sync_batchnorm"], plan["precision"]) == ("gpu", True, "bf16-mixed")
    assert (plan["num_nodes"], plan["devices"]) == (1, 4)


@pytest.mark.parametrize(
    "args, message",
    [
        (["num_workers=two"], "num_workers=two must be an integer >= 1"),
        (["use_gpu=yes"], "use_gpu=yes must be true or false"),
        (["trainer.devices=2"], "trainer.devices=2: Ray Train sets it (one device per worker); pass num_workers=N"),
        (["num_worker=2"], "num_worker: there is no such key; did you mean num_workers?"),
        (["strategy=fsdp"], "strategy=fsdp does not run under Ray Train here: use strategy=ddp, or for FSDP start"),
        # refused only where num_workers is the plan's world size: 100 splits into 1, 2 or 4 devices, not 3
        (["data.global_batch_size=100", "num_workers=3"], "data.global_batch_size=100 "),
        # nothing listens there: refused at once, where Ray would retry for many minutes
        (["address=127.0.0.1:1"], "address=127.0.0.1:1: no Ray cluster answers there within 5 s (Connection refused)"),
    ],
)
def test_a_bad_option_is_one_line_and_exit_2(entry_point, args, message, tmp_path):
    code, lines = entry_point(args)
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {message}"), lines
    assert not (tmp_path / "run").exists()


def test_a_run_directory_with_a_checkpoint_is_resumed_only_when_asked(entry_point, tmp_path):
    """A restarted worker group resumes from the run directory's last.ckpt: an earlier run's would be taken for it."""
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    last.parent.mkdir(parents=True)
    last.write_bytes(b"")
    code, lines = entry_point(["num_workers=2"])
    assert (code, lines) == (
        2,
        [f"error: {last} is an earlier run's: resume it with ckpt_path=last, or pass another hydra.run.dir"],
    )


def test_without_ray_installed_a_job_is_one_line_and_exit_2(entry_point, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails, as where Ray is not installed
    code, lines = entry_point(["num_workers=2"])
    assert (code, lines) == (
        2,
        ['error: Ray is not installed: python -m pip install -e ".[ray]" (a dry run needs no Ray)'],
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["num_workers=4"], "num_workers=4 needs 4 CPU(s) but the Ray cluster has 2; pass num_workers=2 (or use_gpu"),
        (["use_gpu=true"], "num_workers=1 needs 1 GPU(s) but the Ray cluster has 0; pass use_gpu=false"),
    ],
    ids=["more CPUs", "a GPU"],
)
def test_more_than_the_cluster_holds_is_one_line_and_exit_2(ray_cluster, args, message, tmp_path):
    """Ray would wait for ever for 4 CPUs on this 2-CPU cluster, or for a GPU it does not have."""
    log = tmp_path / "driver.log"
    code = ray_train([*args, f"address={ray_cluster}", f"hydra.run.dir={tmp_path / 'run'}"], log).wait(120)
    errors = [line for line in log.read_text().splitlines() if line.startswith("error:")]
    assert code == 2, log.read_text()[-3000:]
    assert len(errors) == 1 and errors[0].startswith(f"error: {message}"), errors
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_mistake_found_by_the_workers_is_the_last_line_and_leaves_no_run_directory(ray_cluster, tmp_path):
    """The batch is larger than the training set: the workers find it (the driver has no data), after writing the log
    and Ray's records into the run directory; the driver prints the error after Ray's own output and removes them."""
    log = tmp_path / "driver.log"
    args = ["data.global_batch_size=4096", f"address={ray_cluster}", f"hydra.run.dir={tmp_path / 'run'}"]
    code = ray_train(args, log).wait(180)
    lines = log.read_text().strip().splitlines()
    assert code == 2, lines[-30:]
    # the message itself is test_errors' ("batch above data"); here, that it is the driver's last line
    assert lines[-1].startswith("error: ") and "data.global_batch_size" in lines[-1], lines[-30:]
    assert not (tmp_path / "run").exists()


def worker_pids(output: str) -> list[dict[int, int]]:
    """{world rank: pid} of each worker group Ray Train started, in order, from its controller's log lines."""
    groups = output.split("Started training worker group")[1:]
    return [
        {int(rank): int(pid) for pid, rank in re.findall(r"pid=(\d+)\) world_rank=(\d+)", group)} for group in groups
    ]


@pytest.mark.slow
def test_two_workers_killed_mid_run_restart_and_end_with_the_one_process_weights(ray_cluster, baseline, tmp_path):
    """The float64 recipe (dropout, augmentation, AdamW, a ramping LR) on 2 Ray workers with max_failures=1. When
    last.ckpt is first written (step 4 of 24, mid-epoch), worker 1 is killed with SIGKILL; Ray restarts the worker
    group, which resumes from last.ckpt. One run directory, written by rank 0: the plan for Ray's world size, exact
    evaluation on uneven shards, and the uninterrupted 1-process run's weights."""
    run_dir = tmp_path / "run"
    log = tmp_path / "driver.log"
    args = [*EXACT, "checkpoint.every_n_train_steps=4", f"hydra.run.dir={run_dir}"]
    driver = ray_train(["num_workers=2", "max_failures=1", f"address={ray_cluster}", *args], log)
    deadline = time.monotonic() + 300  # about 20 s on a quiet machine; minutes on a loaded one
    while not (run_dir / "checkpoints" / "last.ckpt").exists():
        assert driver.poll() is None and time.monotonic() < deadline, log.read_text()[-5000:]
        time.sleep(0.05)
    (first,) = worker_pids(log.read_text())
    signal_sent = time.monotonic()
    os.kill(first[1], signal.SIGKILL)  # kill -9 worker 1
    assert driver.wait(timeout=300) == 0, log.read_text()[-5000:]
    print(f"restarted and finished {time.monotonic() - signal_sent:.0f} s after the kill")

    output = log.read_text()
    groups = worker_pids(output)
    assert len(groups) == 2 and not set(groups[0].values()) & set(groups[1].values()), groups  # a new worker group
    train_log = (run_dir / "train.log").read_text()
    assert "resuming from" in train_log and str(run_dir / "checkpoints" / "last.ckpt") in train_log
    assert sorted(p.name for p in run_dir.iterdir() if p.is_file()) == [
        "config.yaml",
        "metrics.json",
        "plan.json",
        "train.log",
    ]
    plan = read_json(run_dir / "plan.json")
    assert plan["launcher_kind"] == "ray"
    assert (plan["world_size"], plan["per_device_batch_size"], plan["accumulate_grad_batches"]) == (2, 32, 1)
    metrics = read_json(run_dir / "metrics.json")
    assert (metrics["val/samples"], metrics["test/samples"]) == (EXACT_VAL, EXACT_TEST)  # 65/64 and 578/577 per rank
    worst = assert_same_weights(
        weights(baseline("one") / "checkpoints/last.ckpt"), weights(run_dir / "checkpoints/last.ckpt"), 0, TOLERANCE
    )
    print(f"2 Ray workers, one killed and the group restarted, vs 1 process: largest weight difference {worst:.1e}")


def test_the_rayjob_validates_against_kuberays_crd_and_runs_the_entry_point():
    """deploy/kubernetes/rayjob.yaml, strictly against KubeRay's RayJob schema (engine/tests/schemas/, unknown fields
    refused); its entry point parses, plans one GPU per worker pod, resumes the shared run directory, and its Ray is
    the tested one."""
    from scaleup.distributed.ray_train import parse

    job = load(DEPLOY / "rayjob.yaml")
    assert validation_errors(job) == []
    program = shlex.split(job["spec"]["entrypoint"])
    assert program[:3] == ["python", "-m", "scaleup.distributed.ray_train"]
    options, overrides = parse(program[3:])
    args = dict(arg.split("=", 1) for arg in overrides)
    assert args["hydra.run.dir"].startswith("/shared/runs/") and args["ckpt_path"] == "last"
    cluster = job["spec"]["rayClusterSpec"]
    (workers,) = cluster["workerGroupSpecs"]
    (container,) = workers["template"]["spec"]["containers"]
    gpus = workers["replicas"] * int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert (options["num_workers"], options["use_gpu"]) == (gpus, True) and options["max_failures"] >= 1
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # the head runs the driver only
    pinned = re.search(r"^ray==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)[1]
    assert cluster["rayVersion"] == pinned
    text = (DEPLOY / "rayjob.yaml").read_text()
    assert text.count("mountPath: /shared") == 2 and text.count("claimName: scaleup-shared") == 2

    workers["replicas"] = "two"
    job["spec"]["shutdownAfterJobFinish"] = True
    errors = validation_errors(job)
    assert "spec.rayClusterSpec.workerGroupSpecs.0.replicas: 'two' is not of type 'integer'" in errors
    assert any(e.startswith("spec: Additional properties") and "shutdownAfterJobFinish'" in e for e in errors)
