"""The Kubernetes manifests (deploy/kubernetes/): valid for their operators' schemas, and their pods, reproduced on
this machine with exactly the variables each operator sets and exactly the container's command, train as the
template promises.

The operators' behaviour is written out in engine/tests/kubeflow_operators.py, from their source. Locally, the master's
Service name resolves to nothing: MASTER_ADDR becomes 127.0.0.1 and the port a free one, and the shared volume's
/shared a temporary directory; nothing else differs.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed.run as torchrun
from test_launchers import free_port

from conftest import (
    EXACT,
    EXACT_TEST,
    ROOT,
    TOLERANCE,
    assert_same_weights,
    clean_env,
    in_process,
    merged,
    read_json,
    start,
    weights,
)
from kubeflow_operators import command, load, pytorchjob_pods, trainjob_pods, validation_errors
from scaleup.errors import UserError

DEPLOY = ROOT / "deploy" / "kubernetes"
JOBS = ["pytorchjob.yaml", "pytorchjob-torchrun.yaml", "trainjob.yaml"]


@pytest.mark.parametrize("name", JOBS)
def test_manifests_validate_against_the_operators_crds(name):
    """Strictly (unknown fields refused), against the vendored CRD schemas; every pod mounts the shared claim at
    /shared, and the job's run directory and data lie there."""
    job = load(DEPLOY / name)
    assert validation_errors(job) == []
    claim = load(DEPLOY / "shared-volume.yaml")
    assert claim["kind"] == "PersistentVolumeClaim" and claim["spec"]["accessModes"] == ["ReadWriteMany"]
    text = (DEPLOY / name).read_text()
    assert f"claimName: {claim['metadata']['name']}" in text and "mountPath: /shared" in text
    pods = pytorchjob_pods(job) if job["kind"] == "PyTorchJob" else trainjob_pods(job)
    for _, _, spec in pods:
        args = dict(arg.split("=", 1) for arg in command(spec) if "=" in arg)
        assert args["hydra.run.dir"].startswith("/shared/runs/") and args["paths.data_dir"] == "/shared/data"
        assert args["ckpt_path"] == "last"  # the same command starts and restarts the job


def test_a_broken_manifest_names_the_field():
    job = load(DEPLOY / "pytorchjob.yaml")
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "one"
    job["spec"]["runPolicy"]["backofLimit"] = 3
    errors = validation_errors(job)
    assert "spec.pytorchReplicaSpecs.Worker.replicas: 'one' is not of type 'integer'" in errors
    assert any(e.startswith("spec.runPolicy: Additional properties") and "backofLimit" in e for e in errors)


@pytest.mark.parametrize("name", ["pytorchjob-torchrun.yaml", "trainjob.yaml"])
def test_torchrun_reads_what_each_operator_sets(name, monkeypatch):
    """torchrun's own parser, given only each pod's operator variables, finds the nodes, the node rank, the
    processes per node and the master that the command's trainer.devices and trainer.num_nodes describe."""
    job = load(DEPLOY / name)
    pods = pytorchjob_pods(job) if job["kind"] == "PyTorchJob" else trainjob_pods(job)
    grace = int(re.search(r"terminationGracePeriodSeconds: (\d+)", (DEPLOY / name).read_text())[1])
    for index, (_, env, spec) in enumerate(pods):
        for key in [k for k in os.environ if k.startswith("PET_")]:
            monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        program = command(spec)
        assert program[:3] == ["python", "-m", "scaleup.distributed.torchrun"] and "train.py" in program
        args = torchrun.get_args_parser().parse_args(program[3:])  # the wrapper passes its arguments on as they are
        overrides = dict(arg.split("=", 1) for arg in args.training_script_args)
        assert (args.nnodes, args.node_rank, args.nproc_per_node) == (overrides["trainer.num_nodes"], index, "4")
        assert overrides["trainer.devices"] == args.nproc_per_node
        assert args.master_addr == env["PET_MASTER_ADDR"] and args.master_port == int(env["PET_MASTER_PORT"])
        config, _, _ = torchrun.config_from_args(args)
        assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 4)
        assert config.shutdown_timeout < grace  # after SIGTERM, the agent waits for its workers, then the pod goes


@pytest.mark.parametrize(
    ("codes", "passed_on"),
    [((124, 124), 124), ((143, -signal.SIGTERM), 143), ((124, 1), None), ((124, 143), None), ((1, 1), None)],
)
def test_the_torchrun_wrapper_exits_with_the_workers_code_where_every_failed_one_agrees(codes, passed_on, tmp_path):
    """torchrun's agent exits 1 on any failure of its workers; the wrapper exits 124 where each failed worker exited
    124 (a hang the watchdog named), 143 where each stopped on SIGTERM, and keeps torchrun's code where they differ
    or crashed. (On 2 torchrun nodes with a hung rank: test_rank_failures.py.)"""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from scaleup.distributed.torchrun import workers_code

    failures = {
        rank: ProcessFailure(rank, 1000 + rank, code, str(tmp_path / "none.json")) for rank, code in enumerate(codes)
    }
    assert workers_code(ChildFailedError("train.py", failures)) == passed_on


def test_more_devices_than_one_process_per_pod_is_one_clear_message(tmp_path, monkeypatch):
    (_, env, _), _ = pytorchjob_pods(load(DEPLOY / "pytorchjob.yaml"))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(UserError, match=r"this pod runs one process .* but trainer\.devices=2; run torchrun"):
        in_process(["trainer.devices=2", "trainer.accelerator=cpu", f"hydra.run.dir={tmp_path}"])


def start_pods(pods, shared: Path, port: int, extra: list[str], logs: Path) -> list[subprocess.Popen]:
    """Each pod's container command, with the operator's variables, from the repository (the image's workdir);
    its output in `logs/<pod>.log` (a pipe nobody reads while the test waits could fill and stall it)."""
    procs = []
    logs.mkdir(exist_ok=True)
    for name, env, spec in pods:
        program = [arg.replace("/shared", str(shared)) for arg in command(spec)]
        assert program[:2] == ["python", "train.py"]
        local = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "HOSTNAME": name}
        pod = [sys.executable, *merged([*program[1:], *extra])]
        procs.append(start(pod, env=clean_env(**local), log=logs / f"{name}.log"))
    return procs


def exit_codes(procs: list[subprocess.Popen], logs: Path) -> tuple[list[int], str]:
    codes = [proc.wait(timeout=300) for proc in procs]
    return codes, "\n".join(log.read_text()[-3000:] for log in sorted(logs.glob("*.log")))


@pytest.mark.slow
def test_pytorchjob_pods_equal_the_two_process_run_and_resume_after_sigterm(baseline, tmp_path):
    """deploy/kubernetes/pytorchjob.yaml's 2 pods (master and worker, one process each) on the float64 recipe of the
    2-process baseline: the kubelet's SIGTERM to the worker pod stops both with 143 (the manifest's ExitCode policy
    restarts such pods) after writing last.ckpt; the restarted pods, with the same command (ckpt_path=last), resume
    and end with the 2-process Lightning run's weights. The plan names the environment."""
    job = load(DEPLOY / "pytorchjob.yaml")
    assert {spec["restartPolicy"] for spec in job["spec"]["pytorchReplicaSpecs"].values()} == {"ExitCode"}
    pods = pytorchjob_pods(job)
    assert [env["RANK"] for _, env, _ in pods] == ["0", "1"] and pods[0][1]["WORLD_SIZE"] == "2"
    shared = tmp_path / "shared"
    run_dir = shared / "runs" / job["metadata"]["name"]
    # The baseline's recipe; last.ckpt also every 4 steps, so that the pre-emption lands after one.
    recipe = [*EXACT, "checkpoint.every_n_train_steps=4"]

    logs = tmp_path / "logs"
    procs = start_pods(pods, shared, free_port(), recipe, logs)
    deadline = time.monotonic() + 300
    while not (run_dir / "checkpoints" / "last.ckpt").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)  # the worker pod's node is drained
    codes, outputs = exit_codes(procs, logs)
    assert codes == [143, 143], outputs
    assert read_json(run_dir / "plan.json")["launcher_kind"] == "pytorchjob"

    codes, outputs = exit_codes(start_pods(pods, shared, free_port(), recipe, logs), logs)  # the operator restarts
    assert codes == [0, 0], outputs
    assert "resuming from" in (run_dir / "train.log").read_text()
    assert [p.name for p in run_dir.glob("*.log")] == ["train.log"]
    assert read_json(run_dir / "metrics.json")["test/samples"] == EXACT_TEST
    worst = assert_same_weights(
        weights(baseline("two") / "checkpoints/last.ckpt"), weights(run_dir / "checkpoints/last.ckpt"), 0, TOLERANCE
    )
    print(f"2 pods, pre-empted and restarted, vs the 2-process run: largest weight difference {worst:.1e}")


def test_the_image_holds_the_command_s_working_directory():
    """The Dockerfile installs the project where the manifests' commands run (train.py relative to it)."""
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    for name in JOBS:
        text = (DEPLOY / name).read_text()
        assert "image: registry.example.com/scaleup:0.1.0" in text
    assert "WORKDIR /workspace" in dockerfile and "pip install --no-cache-dir -e ." in dockerfile
    assert {c.get("workingDir") for _, _, c in pytorchjob_pods(load(DEPLOY / "pytorchjob.yaml"))} == {"/workspace"}
