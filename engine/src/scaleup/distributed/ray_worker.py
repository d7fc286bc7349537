"""What each Ray Train worker runs: the template's own training job (`scaleup.train.train`) on the config the driver
composed (`ray_train.py`), planned for Ray's world size.

Ray's TorchTrainer has set the ranks (RANK, LOCAL_RANK, WORLD_SIZE, ...) and initialised the process group before
this runs; the worker only fills in what Ray decided and the driver could not know:
- the topology: `trainer.devices` = the workers on this node, `trainer.num_nodes` = world size / that, so the
  plan (per-device batch, accumulation, LR, SyncBN) is computed for Ray's world size, the same on every worker;
- where to start: a restarted worker group (FailureConfig) finds this job's last.ckpt in the run directory and
  resumes from it (`ckpt_path=last`), exactly as a requeued job does;
- Hydra's runtime (the run directory, the log file of rank 0) as `@hydra.main` would have set it up.
"""

from __future__ import annotations

import os
from typing import Any

from hydra.conf import HydraConf
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import configure_log
from omegaconf import DictConfig, OmegaConf

from scaleup.checkpoints.io import exists
from scaleup.distributed.run_dir import register_resolvers
from scaleup.errors import UserError


def last_checkpoint(dirpath: str) -> str:
    """Where the run's last.ckpt is in `checkpoint.dirpath` (on the shared run directory, or a URL)."""
    return f"{dirpath.rstrip('/')}/last.ckpt"


def worker_topology(accelerator: str) -> dict[str, Any]:
    """`trainer.accelerator/devices/num_nodes` for this worker: Lightning indexes a node's devices by local rank, so
    `devices` is the number of workers Ray placed on this node."""
    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if world % local:
        raise UserError(
            f"Ray placed {local} of {world} workers on this node: every node must hold the same number of workers; "
            "make num_workers a multiple of the GPUs per node (or of the CPUs per node without GPUs)"
        )
    return {"accelerator": accelerator, "devices": local, "num_nodes": world // local}


def worker_config(job: dict[str, Any]) -> DictConfig:
    """The job's config for this worker; installs Hydra's runtime and the job's logging as `@hydra.main` does."""
    register_resolvers()
    cfg = OmegaConf.merge(job["config"], {"trainer": worker_topology(job["accelerator"])})
    # The first attempt starts where the user said; a restarted worker group resumes this job's last checkpoint.
    if exists(last_checkpoint(cfg.checkpoint.dirpath)):
        cfg.ckpt_path = "last"
    schema = OmegaConf.structured(HydraConf)
    OmegaConf.set_struct(schema, False)  # Hydra's composed config has keys beyond its schema (`env`)
    hydra = OmegaConf.create({"hydra": OmegaConf.merge(schema, job["hydra"])})
    HydraConfig.instance().set_config(hydra)
    # The logging config is resolved here, per rank: only rank 0 writes the run's log file (rank_zero_or).
    configure_log(hydra.hydra.job_logging, hydra.hydra.verbose)
    return cfg


def train_worker(job: dict[str, Any]) -> None:
    """Ray's `train_loop_per_worker`: the template's train job on this worker's config."""
    from scaleup.train import train

    train(worker_config(job))
