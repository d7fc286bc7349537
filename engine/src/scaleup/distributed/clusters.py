"""Which cluster started this process, read from the variables it sets: the name the plan prints, the node count
for `trainer.num_nodes=auto`, and the cluster environment Lightning does not detect by itself.

- torchrun (also inside a Kubeflow PyTorchJob or TrainJob pod, which hand it PET_* variables; and elastic,
  `--nnodes=MIN:MAX`, where the node count changes between restarts): RANK, LOCAL_RANK, WORLD_SIZE,
  LOCAL_WORLD_SIZE and TORCHELASTIC_RUN_ID for every worker. Lightning detects it.
- SLURM `srun` (also under Hydra's submitit launcher): SLURM_PROCID, SLURM_NTASKS, SLURM_NNODES. Lightning
  detects it.
- A Kubeflow PyTorchJob whose pods run `python train.py` themselves, one process per pod: the operator sets
  MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK (the pod's index) and nothing per process. Lightning has an
  environment for it (`KubeflowEnvironment`: local rank 0, node rank = RANK) but stopped detecting it in 2.0.7
  (Lightning #18137: the same variables are set under torchrun); here it is chosen when no launcher variables
  other than those are set.
- A Ray Train worker (`python -m scaleup.distributed.ray_train`): Ray's TorchTrainer starts one process per worker,
  sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and NODE_RANK, and initialises the process group itself
  before the job runs. Lightning detects none of it; Ray's own `RayLightningEnvironment` reads the ranks from
  `ray.train.get_context()`, and Lightning leaves the group Ray made as it is.
- Otherwise Lightning's own launcher (`trainer.devices=N` on one node), or one process.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from lightning.fabric.plugins.environments import ClusterEnvironment, KubeflowEnvironment

from scaleup.errors import UserError

OPERATOR_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


def is_torchrun() -> bool:
    return os.environ.get("TORCHELASTIC_RUN_ID") is not None and "WORLD_SIZE" in os.environ


def is_slurm() -> bool:
    """Lightning's own test: SLURM_NTASKS set, and not an interactive allocation (`salloc bash`)."""
    return "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def is_ray_train() -> bool:
    """A process Ray Train started for its training function: Ray is imported here (only a Ray process imports it
    before the job runs) and its train context answers."""
    if "ray" not in sys.modules:
        return False
    import ray.train

    try:
        ray.train.get_context()
    except RuntimeError:  # the driver, or any other Ray process
        return False
    return True


def is_one_process_per_pod() -> bool:
    """The ranks of a PyTorchJob without torchrun: the operator's four variables, and no launcher's of its own
    (torchrun and Lightning's launcher set LOCAL_RANK for each process they start)."""
    return (
        all(name in os.environ for name in OPERATOR_VARIABLES)
        and "LOCAL_RANK" not in os.environ
        and not is_torchrun()
        and not is_slurm()
    )


@dataclass(frozen=True)
class Launcher:
    """What started the processes, for the plan: a key of plan/resolve.py's LAUNCHERS (which says it in words),
    torchrun's restart count and SLURM's job id where they apply."""

    kind: str
    restarts: int = 0
    job: str = ""


def launcher_of(world_size: int) -> Launcher:
    """What started the processes, read from the variables it set."""
    if is_ray_train():  # first: Ray's workers may inherit the variables of the allocation Ray itself runs in
        return Launcher("ray")
    if is_torchrun():
        kind = "kubeflow_torchrun" if "PET_NNODES" in os.environ else "torchrun"
        return Launcher(kind, restarts=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    if is_slurm():
        return Launcher("slurm", job=os.environ.get("SLURM_JOB_ID", ""))
    if is_one_process_per_pod():
        return Launcher("pytorchjob")
    return Launcher("lightning" if world_size > 1 else "one_process")


def launched_world_size() -> tuple[str, int] | None:
    """(launcher, world size) where the processes were started outside Lightning, else None."""
    if is_ray_train():  # first, as in launcher_of
        return "Ray Train", int(os.environ["WORLD_SIZE"])
    if is_torchrun():
        return "torchrun", int(os.environ["WORLD_SIZE"])
    if is_slurm():
        return "SLURM", int(os.environ["SLURM_NTASKS"])
    if is_one_process_per_pod():
        return "the PyTorchJob", int(os.environ["WORLD_SIZE"])
    return None


def launched_nodes() -> int:
    """`trainer.num_nodes=auto`: the nodes the launcher started now (under elastic torchrun, those that joined this
    round: fewer after a node is lost), else 1."""
    if is_torchrun():
        return int(os.environ["WORLD_SIZE"]) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if is_slurm():
        return int(os.environ.get("SLURM_NNODES", 1))
    if is_one_process_per_pod():
        return int(os.environ["WORLD_SIZE"])
    return 1


def check_one_process_per_pod(devices: int) -> None:
    """A pod that runs `python train.py` is one process: its other devices would need ranks the operator never
    gave (it numbers pods, not processes)."""
    if is_one_process_per_pod() and devices != 1:
        raise UserError(
            f"this pod runs one process (a PyTorchJob without torchrun sets RANK per pod) but trainer.devices="
            f'{devices}; run torchrun in the container with nprocPerNode: "{devices}" '
            "(deploy/kubernetes/pytorchjob-torchrun.yaml), or keep one device per pod: trainer.devices=1"
        )


def cluster_plugins() -> list[ClusterEnvironment]:
    """The cluster environment to pass to the Trainer where Lightning would not find the ranks by itself."""
    if is_one_process_per_pod():
        return [KubeflowEnvironment()]
    if is_ray_train():
        # Ray's own environment, not its strategies: RayDDPStrategy (and prepare_trainer, which insists on it)
        # would replace the template's strategy; the environment works with any.
        from ray.train.lightning import RayLightningEnvironment

        return [RayLightningEnvironment()]
    return []
