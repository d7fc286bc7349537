"""Hydra sweeps through submitit (`pip install -e ".[slurm]"`): `hydra/launcher=submitit_slurm` writes the sbatch
script that srun's one task per device on every node (submitted to a stand-in `sbatch` that keeps the script: no
SLURM here). `hydra/launcher=submitit_local` runs a sweep here: engine/tests/test_launchers.py's
test_multirun_needs_no_extra_keys[seeds]."""

import os
import re

import pytest
from test_launchers import slurm_env

from conftest import QUICK, clean_env, engine_section, run
from scaleup.distributed.launch import build_strategy

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the [slurm] extra is not installed")

TINY = [*QUICK, "trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"]
TINY += ["trainer.limit_test_batches=1", "logger=none"]


@pytest.mark.slow
def test_submitit_slurm_runs_one_srun_task_per_device_on_every_node(tmp_path):
    """The sbatch script of `-m hydra/launcher=submitit_slurm trainer.devices=4 trainer.num_nodes=2 seed=1,2`: an
    array of 2 jobs, each 2 nodes x 4 tasks (one per GPU) started by srun, USR2 120 s before the time limit."""
    bin_dir, script = tmp_path / "bin", tmp_path / "job.sbatch"
    bin_dir.mkdir()
    # submitit looks for srun, then submits with `sbatch <script>`: this one keeps the script and refuses.
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\ncp "$1" {script}\necho "sbatch: no cluster here" >&2\nexit 1\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = clean_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    args = ["-m", "hydra/launcher=submitit_slurm", "trainer.devices=4", "trainer.num_nodes=2", "seed=1,2"]
    result = run(args, env=env, cwd=tmp_path, timeout=120)
    assert result.returncode != 0 and "sbatch: no cluster here" in result.stderr
    options = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", script.read_text(), flags=re.MULTILINE))
    assert {key: options[key] for key in ("array", "nodes", "ntasks-per-node", "gpus-per-node", "signal")} == {
        "array": "0-1%2",
        "nodes": "2",
        "ntasks-per-node": "4",
        "gpus-per-node": "4",
        "signal": "USR2@120",
    }
    (srun,) = [line for line in script.read_text().splitlines() if line.startswith("srun ")]
    assert " -m submitit.core._submit " in srun  # every task runs the sweep job: Lightning reads its SLURM rank


def test_a_sweep_job_that_srun_started_keeps_plain_ddp(monkeypatch):
    """Each of srun's tasks is one rank: spawning more from it, as a local multirun does (Lightning #11300),
    would start devices x devices processes."""
    for name, value in slurm_env(0).items():
        if name.startswith("SLURM_"):
            monkeypatch.setenv(name, value)
    assert build_strategy(engine_section("strategy/ddp"), world_size=2, multirun=True)[1] == "ddp"
    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    assert build_strategy(engine_section("strategy/ddp"), world_size=2, multirun=True)[1] == "ddp_spawn"
