"""Every launcher gives one run directory, one log file, one metrics.json, and correct ranks (CPU, gloo, loopback)."""

import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import (
    EXACT_TEST,
    QUICK,
    check,
    clean_env,
    in_process,
    merged,
    read_json,
    run,
    run_command,
    start,
)
from scaleup.errors import UserError

pytestmark = pytest.mark.slow

ONE_EPOCH = [*QUICK, "trainer.max_epochs=1", "+callbacks.probe._target_=probes.RankProbe"]


def free_port() -> int:
    """A free port below the kernel's ephemeral range (32768-60999 on Linux). The kernel hands ports of that range to
    every outgoing connection, and gloo opens many: a port from it can be taken by the time the launcher binds it."""
    for port in random.Random().sample(range(20000, 32000), 200):
        if bindable(port):
            return port
    raise RuntimeError("no free port in 20000-32000")


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def torchrun(
    *torchrun_args: str, args: list[str], env=None, timeout=300, module="torch.distributed.run"
) -> subprocess.CompletedProcess:
    return run_command(
        [sys.executable, "-m", module, *torchrun_args, "train.py", *merged(args)], env=env, timeout=timeout
    )


def only_run_dir(log_dir):
    """The single run directory under paths.log_dir, asserting there is exactly one."""
    (run_dir,) = [p for p in (log_dir / "train").iterdir()]
    return run_dir


def assert_one_clean_run(run_dir, world_size=2, test_samples=360):
    assert [p.name for p in run_dir.glob("*.log")] == ["train.log"]
    assert (run_dir / "metrics.json").is_file() and read_json(run_dir / "plan.json")["world_size"] == world_size
    assert read_json(run_dir / "metrics.json")["test/samples"] == test_samples
    ranks = [read_json(run_dir / "probe" / f"rank{r}.json") for r in range(world_size)]
    assert [r["rank"] for r in ranks] == list(range(world_size))
    assert {r["world_size"] for r in ranks} == {world_size}
    return ranks


def probe_dir_arg(log_dir):
    # The run dir is not known in advance: ask the probe to write inside whatever Hydra resolved.
    return "+callbacks.probe.out_dir=${hydra:runtime.output_dir}/probe"


def test_lightning_launcher_one_run_dir(baseline):
    """`python train.py trainer.devices=2`: the shared 2-process baseline, which named its own run directory."""
    ranks = assert_one_clean_run(baseline("two"), test_samples=EXACT_TEST)
    assert [r["local_rank"] for r in ranks] == [0, 1]


def test_multi_node_torchrun_without_shared_run_dir_is_one_clear_message(tmp_path, monkeypatch):
    """What node 0 of `torchrun --nnodes=2` without --rdzv-id sets: no name every node would agree on."""
    environment = {"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "RANK": "0"}
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(Exception, match=r"give every node the same shared run directory with hydra\.run\.dir="):
        in_process([*QUICK, "trainer.num_nodes=2", f"paths.log_dir={tmp_path}"])
    assert not (tmp_path / "train").exists()


def slurm_env(rank: int, ntasks: int = 2, port: int = 0) -> dict[str, str]:
    """What `srun --ntasks-per-node=2` on one node sets for task `rank`."""
    return clean_env(
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="train",
        SLURM_NTASKS=str(ntasks),
        SLURM_NTASKS_PER_NODE=str(ntasks),
        SLURM_NNODES="1",
        SLURM_NODELIST="127.0.0.1",
        SLURM_PROCID=str(rank),
        SLURM_LOCALID=str(rank),
        SLURM_NODEID="0",
        SLURM_STEP_ID="0",
        MASTER_PORT=str(port),
    )


def test_slurm_srun_environment(tmp_path):
    port = free_port()
    args = [*ONE_EPOCH, "trainer.devices=2", f"paths.log_dir={tmp_path}", probe_dir_arg(tmp_path)]
    tasks = [start([sys.executable, "train.py", *merged(args)], env=slurm_env(rank, port=port)) for rank in (0, 1)]
    outputs = [task.communicate(timeout=300)[0] for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], outputs
    run_dir = only_run_dir(tmp_path)
    assert run_dir.name == "slurm-4242"  # named after the job: a requeued job finds its checkpoints again
    ranks = assert_one_clean_run(run_dir)
    assert [r["local_rank"] for r in ranks] == [0, 1]


def test_slurm_task_count_mismatch_is_one_clear_message(tmp_path, monkeypatch):
    for name, value in slurm_env(0).items():
        if name.startswith("SLURM_"):
            monkeypatch.setenv(name, value)
    # srun's task count is the launcher's; the message is test_errors' (test_launcher_and_config_disagree)
    with pytest.raises(UserError, match=r"^SLURM started 2 process\(es\) but "):
        in_process([*QUICK, "trainer.devices=1", f"paths.log_dir={tmp_path}"])


@pytest.mark.parametrize(
    ("sweep", "plans"),
    [
        # Through submitit's local launcher (the [slurm] extra): the sweep a SLURM user types, run here (one
        # epoch each: the sweep needs no key, the length is the test's).
        (["hydra/launcher=submitit_local", "seed=1,2", "trainer.max_epochs=1"], [("seed", 1), ("seed", 2)]),
        (
            ["data=digits,synthetic", "dry_run=true"],
            [("steps_per_epoch", 1257 // 64), ("steps_per_epoch", 4096 // 64)],
        ),
    ],
    ids=["seeds", "groups"],
)
def test_multirun_needs_no_extra_keys(sweep, plans, tmp_path):
    """The sweeps a user types first, exactly as typed: one sweep directory in ./outputs, a run directory per job
    (for submitit's jobs: each a clean run, with one log, metrics.json and last.ckpt, and submitit's results)."""
    result = check(run(["-m", *sweep], timeout=600, cwd=tmp_path))
    (sweep_dir,) = (tmp_path / "outputs" / "train-sweep").iterdir()
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")) == ["0", "1"]
    assert [
        (key, read_json(sweep_dir / job / "plan.json")[key]) for job, (key, _) in zip("01", plans, strict=True)
    ] == plans
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "outputs" / "train").exists()  # no stray per-job run directories
    if "hydra/launcher=submitit_local" in sweep:
        for job in ("0", "1"):
            assert [p.name for p in (sweep_dir / job).glob("*.log")] == ["train.log"]
            assert (sweep_dir / job / "metrics.json").is_file()
            assert (sweep_dir / job / "checkpoints" / "last.ckpt").is_file()
        assert len(list((sweep_dir / ".submitit").glob("*/*_result.pkl"))) == 2  # submitit ran both jobs


def test_a_failing_rank_stops_every_process_quickly(tmp_path):
    """Lightning's launcher: rank 1 raises at step 3; rank 0 must not wait for it in the next collective until
    the process-group timeout. (Under torchrun the agent stops the other workers: the restart test below.)"""
    args = [
        *QUICK,
        "trainer.max_epochs=5",
        "trainer.devices=2",
        "+callbacks.fail._target_=probes.FailOnRank",
        "+callbacks.fail.rank=1",
        "+callbacks.fail.step=3",
        f"paths.log_dir={tmp_path}",
    ]
    start = time.monotonic()
    result = run(args, timeout=120)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "injected failure on rank 1 at step 3" in result.stdout + result.stderr
    assert elapsed < 90, f"took {elapsed:.0f} s to stop"
    print(f"all processes stopped {elapsed:.1f} s after start, exit {result.returncode}")


def test_torchrun_restarts_failed_workers_and_its_agent_exits_143_on_sigterm(tmp_path):
    """scaleup.distributed.torchrun on one node, 2 workers, `--max-restarts=1`, 2 epochs of 19 steps:
    - rank 1 fails once at step 25: torchrun stops rank 0 and restarts both, which find the same run directory and
      resume from its last.ckpt (step 19);
    - SIGTERM to the agent at step 30 (as Kubernetes signals a pod's torchrun) stops both workers with last.ckpt
      written, and the agent exits 143 (torchrun's own exits 1), so `restartPolicy: ExitCode` restarts the pod;
    - the command run again resumes from that last.ckpt and ends: one clean run, one log."""
    run_dir = tmp_path / "run"
    args = [
        *ONE_EPOCH,
        "trainer.max_epochs=2",
        "trainer.devices=2",
        "ckpt_path=last",
        f"hydra.run.dir={run_dir}",
        probe_dir_arg(tmp_path),
        "+callbacks.fail._target_=probes.FailOnRank",
        "+callbacks.fail.rank=1",
        "+callbacks.fail.step=25",
        "+callbacks.fail.first_attempt_only=true",
    ]
    signal_agent = ["+callbacks.sigterm._target_=probes.SigtermParentAtStep", "+callbacks.sigterm.step=30"]
    # One node, its rendezvous at a port chosen here (--standalone would take an ephemeral one, which another
    # process's connection may hold by then).
    node = ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--nproc_per_node=2"]
    wrapper = {"module": "scaleup.distributed.torchrun"}
    stopped = torchrun(*node, "--max-restarts=1", args=[*args, *signal_agent], **wrapper)
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 143, output[-6000:]
    assert "injected failure" in output and "torchrun: pre-empted (the agent got SIGTERM)" in stopped.stderr
    step = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]
    assert 30 < step < 38  # soon after the agent passed the signal on, as the workers agreed
    assert not (run_dir / "metrics.json").exists()
    node[2] = f"--rdzv-endpoint=127.0.0.1:{free_port()}"
    check(torchrun(*node, args=args, **wrapper))
    log = (run_dir / "train.log").read_text()
    assert log.count(f"resuming from {run_dir / 'checkpoints' / 'last.ckpt'}") == 2  # the restart, the rerun
    assert_one_clean_run(run_dir)


def test_an_unwritable_working_directory_is_one_line():
    """The default run directory is ./outputs/train/<stamp>: where it cannot be created, one line names it."""
    result = run(["dry_run=true"], cwd=Path("/proc"))  # nothing can be created under /proc, not even by root
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: cannot create the run directory /proc/outputs/train/"), result.stderr
