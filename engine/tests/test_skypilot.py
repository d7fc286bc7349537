"""deploy/skypilot/train.yaml: its `run` script, executed by bash with the variables SkyPilot sets on node 1 of
2, starts torchrun as node 1 of 2 with 8 processes and the head node as master, and train.py with the same
topology; the overrides compose."""

import json
import subprocess
import sys

import torch.distributed.run as torchrun
import yaml

from conftest import ROOT, in_process

TASK = ROOT / "deploy" / "skypilot" / "train.yaml"


def test_the_task_runs_torchrun_on_skypilots_topology(tmp_path):
    task = yaml.safe_load(TASK.read_text())
    gpus = int(task["resources"]["accelerators"].split(":")[1])
    env = {
        **task["envs"],
        "PATH": "/usr/bin:/bin",
        "SKYPILOT_NODE_RANK": "1",
        "SKYPILOT_NUM_NODES": str(task["num_nodes"]),
        "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus),
        "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2",
    }
    # torchrun, as a shell function: prints the arguments it was given.
    stub = f'torchrun() {{ {sys.executable} -c "import json, sys; print(json.dumps(sys.argv[1:]))" "$@"; }}\n'
    result = subprocess.run(["bash", "-c", stub + task["run"]], env=env, capture_output=True, text=True, check=True)
    args = torchrun.get_args_parser().parse_args(json.loads(result.stdout))
    assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("2", 1, "8")
    assert (args.master_addr, args.training_script) == ("10.0.0.1", "train.py")
    overrides = dict(arg.split("=", 1) for arg in args.training_script_args)
    assert (overrides["trainer.devices"], overrides["trainer.num_nodes"]) == ("8", "2")
    assert overrides["ckpt_path"] == "last"
    assert overrides["checkpoint.dirpath"] == "s3://my-bucket/scaleup/scaleup-cifar10/checkpoints"
    assert "s3fs" in task["setup"]  # fsspec's s3:// filesystem
    # The topology as the task states it, planned on the suite's own task (the example's experiment is the manifest's)
    assert overrides["experiment"] == "cifar10_resnet18"
    planned = {k: v for k, v in overrides.items() if k not in ("ckpt_path", "hydra.run.dir", "experiment")}
    plan = in_process([*(f"{k}={v}" for k, v in planned.items()), "dry_run=true", f"hydra.run.dir={tmp_path}"])
    assert (plan["world_size"], plan["global_batch_size"], plan["per_device_batch_size"]) == (16, 64, 4)
