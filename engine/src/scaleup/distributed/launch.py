"""What differs between launchers: the DDP strategy, the launcher check, a torchrun restart, leaving together."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.utils import instantiate
from lightning.pytorch.strategies import DDPStrategy

from scaleup.compat.launch import SpawnDDPStrategy
from scaleup.config.typed import values
from scaleup.distributed.clusters import (
    Launcher,
    check_one_process_per_pod,
    cluster_plugins,
    launched_world_size,
    launcher_of,
)
from scaleup.distributed.process_group import shut_down_process_group
from scaleup.errors import UserError, config_errors
from scaleup.plan.topology import Topology
from scaleup.registry import registered

if TYPE_CHECKING:
    from scaleup.config.schema import Strategy

log = logging.getLogger("scaleup")

_RESTART_STORE: Any = None  # rank 0's store for a restarted torchrun attempt, alive as long as the process


def fresh_store_after_torchrun_restart() -> None:
    """After `torchrun --max-restarts` restarts the workers, give the new attempt a store of its own.

    torchrun's workers meet in the agent's store, which outlives a restart: the restarted ranks then read the
    dead attempt's addresses from it and fail with "Connection refused". Rank 0 hosts a new store instead, on a
    port the system gives it (a port picked in advance could be taken, by a gloo connection, before it binds), and
    announces the port through the agent's store; every rank then meets there as torchrun's workers meet in the
    agent's (TORCHELASTIC_USE_AGENT_STORE: all are clients of the store at MASTER_ADDR:MASTER_PORT).
    """
    global _RESTART_STORE
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    from torch.distributed import TCPStore

    host, key = os.environ["MASTER_ADDR"], f"scaleup/restart_{attempt}/port"
    agent = TCPStore(host, int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(minutes=5))
    if int(os.environ["RANK"]) == 0:
        _RESTART_STORE = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        agent.set(key, str(_RESTART_STORE.port))
    os.environ["MASTER_PORT"] = agent.get(key).decode()


@dataclass(frozen=True)
class Launch:
    """How the run's processes train together: the Trainer's `strategy`, its name and the launcher's, for the plan."""

    strategy: Any
    name: str
    launcher: Launcher


def check_launch(topology: Topology, *, dry_run: bool) -> None:
    """Before anything is built: check the launcher against the topology and get a restarted torchrun ready (a dry
    run launches nothing)."""
    if not dry_run:
        check_launcher(topology)
        fresh_store_after_torchrun_restart()


def shards_the_model(strategy: Strategy, world_size: int) -> bool:
    """Whether the strategy shards the model (FSDP on more than one process; one process trains as DDP's does)."""
    return strategy.name == "fsdp" and world_size > 1


def prepare_launch(
    strategy: Strategy,
    topology: Topology,
    *,
    multirun: bool,
    dry_run: bool,
    async_save: bool | str = "auto",
) -> Launch:
    """Build the strategy, before the model: a strategy may build the model itself (strategy=fsdp's `build_model`, on
    the meta device). `async_save`: `checkpoint.async_save`."""
    with config_errors("strategy"):
        built, name = build_strategy(strategy, topology.world_size, multirun, async_save, num_nodes=topology.num_nodes)
    if dry_run:
        launcher = Launcher("dry_run")
    elif name == "ddp_spawn" and launched_world_size() is None:
        launcher = Launcher("spawn")
    else:
        launcher = launcher_of(topology.world_size)
    return Launch(built, name, launcher)


def build_strategy(
    strategy: Strategy,
    world_size: int,
    multirun: bool,
    async_save: bool | str = "auto",
    num_nodes: int = 1,
) -> tuple[Any, str]:
    """The Trainer's `strategy` argument and a name for the plan, from the `strategy` config group.

    One process runs without a strategy. Under a Hydra multirun sweep Lightning's default subprocess launcher
    would re-run the whole sweep in every child process (Lightning issue #11300), so sweeps start their
    processes with spawn instead.
    """
    name = strategy.name
    timeout = timedelta(minutes=float(strategy.timeout_minutes))
    if world_size > 1:
        warn_if_collectives_time_out_first(strategy)
    # hang_timeout_minutes: the watchdog's (callbacks/preemption.py)
    engine_keys = ("name", "timeout_minutes", "hang_timeout_minutes")
    options = {key: value for key, value in values(strategy).items() if key not in engine_keys}
    # An option that names its own Lightning strategy (strategy=fsdp: distributed/fsdp.py's), built on 2 or more
    # processes: one process has nothing to shard, it trains as DDP's single process does and writes one file.
    if "_target_" in options and world_size > 1:
        built = instantiate(
            options,
            world_size=world_size,
            num_nodes=num_nodes,
            timeout=timeout,
            async_save=async_save,
            _convert_="all",
        )
        return built, name
    if async_save is True:
        raise UserError(
            "checkpoint.async_save=true writes sharded checkpoints (strategy=fsdp on 2 or more processes) in the "
            "background; this run writes one-file checkpoints, which are saved at once: use auto or false"
        )
    if "_target_" in options:
        return "auto", "auto"
    if name not in ("ddp", "ddp_spawn"):
        raise UserError(
            f"strategy.name={name}: this strategy group names no Lightning strategy (_target_); start it from the "
            f"engine's option (defaults: [{name}, _self_] at its top), or choose strategy={name}"
        )
    if world_size == 1:
        return "auto", "auto"
    if name == "ddp" and multirun and launched_world_size() is None:  # srun (submitit) started every process
        name = "ddp_spawn"
    if name == "ddp_spawn":
        own = not cluster_plugins()  # else the Trainer takes the cluster's environment from its plugins
        return SpawnDDPStrategy(on_exit=shut_down_process_group, own_environment=own, timeout=timeout, **options), name
    return DDPStrategy(start_method="popen", timeout=timeout, **options), name


def warn_if_collectives_time_out_first(strategy: Strategy) -> None:
    """A process-group timeout below the hang bound: a rank waiting for a hung one fails in its collective before the
    hang watch would name it (it is named then, from the timeout), and a slow step has less time than the bound."""
    from lightning.pytorch.utilities import rank_zero_only

    hang = strategy.hang_timeout_minutes
    if hang and strategy.timeout_minutes < hang and rank_zero_only.rank == 0:
        log.warning(
            f"strategy.timeout_minutes={strategy.timeout_minutes:g} is below strategy.hang_timeout_minutes={hang:g}: "
            "collectives time out before the hang watch's bound; set timeout_minutes above it (the time a slow step, "
            "a compile or a checkpoint may take)"
        )


def watch_the_set_up(strategy: Strategy, topology: Topology, run_dir: Path, *, multirun: bool) -> None:
    """Where the launcher re-runs the script in every process (Lightning's, torchrun, srun), start this rank's hang
    watch (the failure watch, distributed/watchdog.py) before its set-up (the data, the model, the plan): a rank that
    hangs there while the others wait in the rendezvous is named, with its stack, before the rendezvous times out.
    Without a hang bound (strategy.hang_timeout_minutes 0 or null), such a rank ends with its stack once the
    rendezvous failed and strategy.timeout_minutes passed: none is left running. Spawned processes (ddp_spawn, a
    sweep's) run no set-up of their own: their watch starts with the Trainer's."""
    spawned = launched_world_size() is None and (strategy.name == "ddp_spawn" or multirun)
    if topology.world_size == 1 or spawned:
        return
    watch = registered("job_watch", "default")  # the failure watch's part (registry.py), where it is installed
    if watch is None:
        return
    watch.watch_the_set_up(
        rank=launched_rank(topology),
        world_size=topology.world_size,
        run_dir=run_dir,
        hang_seconds=60 * strategy.hang_timeout_minutes if strategy.hang_timeout_minutes else None,
        collective_seconds=60 * strategy.timeout_minutes,
    )


def launched_rank(topology: Topology) -> int:
    """This process's global rank, as the launcher set it: torchrun's (and a PyTorchJob's, one process per pod)
    RANK, SLURM's task, or Lightning's launcher's node and local rank."""
    for name in ("RANK", "SLURM_PROCID"):
        if name in os.environ:
            return int(os.environ[name])
    return int(os.environ.get("NODE_RANK", 0)) * topology.devices + int(os.environ.get("LOCAL_RANK", 0))


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
