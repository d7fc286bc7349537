"""What differs between launchers: who is rank 0, one shared run directory, the DDP strategy."""

from __future__ import annotations

import hashlib
import os
import uuid
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from omegaconf import OmegaConf

from scaleup.compat.workarounds import SpawnDDPStrategy
from scaleup.distributed.clusters import check_one_process_per_pod, launched_world_size
from scaleup.errors import UserError
from scaleup.plan.topology import Topology

RANK_VARIABLES = ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")


def is_rank_zero_from_env() -> bool:
    """Rank 0 before any process group exists: every launcher's rank variable is unset or 0.

    torchrun sets RANK, srun SLURM_PROCID, Lightning's own launcher LOCAL_RANK/NODE_RANK in its children.
    """
    return all(int(os.environ.get(name, 0)) == 0 for name in RANK_VARIABLES)


def _process_start_time(pid: int) -> datetime | None:
    """Start time of a process from /proc (Linux), or None."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
        )
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return datetime.fromtimestamp(boot) + timedelta(seconds=ticks / os.sysconf("SC_CLK_TCK"))


def _is_uuid(text: str) -> bool:
    try:
        return str(uuid.UUID(text)) == text
    except ValueError:
        return False


def run_stamp() -> str:
    """A run name that every process of one launch agrees on, without talking to each other.

    Each process resolves Hydra's config on its own, so `${now:...}` can differ by a second between ranks
    and split one run into several directories. Instead:
    - SLURM: the job id (a requeued job gets the same directory back, so `ckpt_path=last` resumes it);
    - torchrun with a rendezvous id (`--rdzv-id`, not --standalone's made-up one): that id, on every node and
      whatever the node count of an elastic job;
    - torchrun on one node: the start time of the torchrun agent, the parent of all local workers (the same
      after `--max-restarts` restarts them);
    - torchrun on several nodes without an id: an error asking for hydra.run.dir;
    - otherwise (a plain `python train.py`; Lightning passes its run dir to the processes it starts): now.
    """
    if "SLURM_JOB_ID" in os.environ and "SLURM_PROCID" in os.environ:
        step = os.environ.get("SLURM_STEP_ID")
        return f"slurm-{os.environ['SLURM_JOB_ID']}" + (f".{step}" if step not in (None, "0", "batch") else "")
    if "TORCHELASTIC_RUN_ID" in os.environ:
        run_id = os.environ["TORCHELASTIC_RUN_ID"]
        given = bool(run_id) and run_id != "none"
        # An id the user gave names the run on every node, also after an elastic job lost a node (then
        # WORLD_SIZE = LOCAL_WORLD_SIZE on the survivor); --standalone makes up a uuid of its own.
        if given and not _is_uuid(run_id):
            return f"torchrun-{run_id}"
        if os.environ.get("WORLD_SIZE") == os.environ.get("LOCAL_WORLD_SIZE"):
            started = _process_start_time(os.getppid())
            if started is not None:
                return started.strftime("%Y-%m-%d_%H-%M-%S")
        if given:
            return f"torchrun-{run_id}"
        raise ValueError(
            "multi-node torchrun without a rendezvous id: give every node the same shared run directory with "
            "hydra.run.dir=/shared/path/run-name (or pass --rdzv-id=NAME to torchrun)"
        )
    return datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def run_id(run_dir: str | Path) -> str:
    """An id that depends only on the run directory: a requeued or resumed job (same directory) continues the same
    logger run, and the processes of one run share one data-preparation lock, while other runs get their own."""
    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def rank_zero_or(value: Any, other: Any = None) -> Any:
    return value if is_rank_zero_from_env() else other


def register_resolvers() -> None:
    """Resolvers the configs use; call before Hydra composes the config."""
    if not OmegaConf.has_resolver("run_stamp"):
        OmegaConf.register_new_resolver("run_stamp", run_stamp, use_cache=True)
    if not OmegaConf.has_resolver("rank_zero_or"):
        OmegaConf.register_new_resolver("rank_zero_or", rank_zero_or)
    if not OmegaConf.has_resolver("cwd"):
        # The working directory, for paths.root_dir: unlike ${hydra:runtime.cwd}, it resolves before Hydra's
        # runtime config exists, as a multirun's sweep directory must.
        OmegaConf.register_new_resolver("cwd", os.getcwd)
    if not OmegaConf.has_resolver("devnull"):
        OmegaConf.register_new_resolver("devnull", lambda: os.devnull)


def fresh_store_after_torchrun_restart() -> None:
    """After `torchrun --max-restarts` restarts the workers, give the new attempt a store of its own.

    torchrun's workers meet in the agent's store, which outlives a restart: the restarted ranks then read the
    dead attempt's addresses from it and fail with "Connection refused". Rank 0 hosts a new store instead, on
    the port after the agent's one for each attempt (MASTER_PORT + restart count).
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if attempt > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
        os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + attempt)


def shut_down_process_group() -> None:
    """Leave the process group together: a rank that exits while a peer still holds gloo connections can
    abort in C++ ("terminate called without an active exception") and fail an otherwise finished run."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def build_strategy(strategy_cfg: dict[str, Any], world_size: int, multirun: bool) -> tuple[Any, str]:
    """The Trainer's `strategy` argument and a name for the plan, from the `strategy` config group.

    One process runs without a strategy. Under a Hydra multirun sweep Lightning's default subprocess launcher
    would re-run the whole sweep in every child process (Lightning issue #11300), so sweeps start their
    processes with spawn instead.
    """
    options = dict(strategy_cfg)
    name = str(options.pop("name"))
    timeout = timedelta(minutes=float(options.pop("timeout_minutes", 30)))
    if name == "fsdp":
        from scaleup.distributed.fsdp import FSDPStrategy

        # One process has nothing to shard: it trains as DDP's single process does, and writes one file.
        if world_size == 1:
            return "auto", "auto"
        return FSDPStrategy(world_size=world_size, timeout=timeout, **options), name
    if name not in ("ddp", "ddp_spawn"):
        raise UserError(f"strategy.name={name} is not one of ddp, ddp_spawn, fsdp")
    if world_size == 1:
        return "auto", "auto"
    if name == "ddp" and multirun and launched_world_size() is None:  # srun (submitit) started every process
        name = "ddp_spawn"
    if name == "ddp_spawn":
        return SpawnDDPStrategy(on_exit=shut_down_process_group, timeout=timeout, **options), name
    return DDPStrategy(start_method="popen", timeout=timeout, **options), name


def check_launcher(topology: Topology) -> None:
    """torchrun and srun fix the number of processes; it must match trainer.devices x trainer.num_nodes."""
    check_one_process_per_pod(topology.devices)
    launched = launched_world_size()
    if launched and launched[1] != topology.world_size:
        launcher, size = launched
        raise UserError(
            f"{launcher} started {size} process(es) but trainer.devices x trainer.num_nodes = "
            f"{topology.devices} x {topology.num_nodes} = {topology.world_size}; make them equal "
            f"(e.g. trainer.devices={size // topology.num_nodes} trainer.num_nodes={topology.num_nodes})"
        )
    if launched and launched[0] == "SLURM":
        per_node, nodes = os.environ.get("SLURM_NTASKS_PER_NODE"), os.environ.get("SLURM_NNODES")
        if per_node and per_node.isdigit() and int(per_node) != topology.devices:
            raise UserError(
                f"SLURM runs --ntasks-per-node={per_node} but trainer.devices={topology.devices}: one task per "
                f"device, so pass trainer.devices={per_node}"
            )
        if nodes and int(nodes) != topology.num_nodes:
            raise UserError(f"SLURM runs --nodes={nodes} but trainer.num_nodes={topology.num_nodes}; make them equal")
