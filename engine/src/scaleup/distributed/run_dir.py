"""One run directory per run, whatever launched it: who is rank 0 before any process group exists, the run's
stamp and id, and the resolvers the configs use."""

from __future__ import annotations

import hashlib
import os
import uuid
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

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
    if not OmegaConf.has_resolver("config_groups"):
        from scaleup.config.project import config_groups

        OmegaConf.register_new_resolver("config_groups", config_groups)  # --help's list (conf/hydra/help/groups.yaml)
