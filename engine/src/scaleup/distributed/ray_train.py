"""Train on a Ray cluster with Ray Train: `python -m scaleup.distributed.ray_train`.

    python -m scaleup.distributed.ray_train num_workers=N [use_gpu=true] [cpus_per_worker=C] [max_failures=K]
        [address=ADDR] [overrides]

num_workers: Ray Train workers, one process and one device each (default 1); the world size. use_gpu: one GPU per
worker (default false: CPUs only). cpus_per_worker: CPUs Ray reserves for each worker (default 1; the loader's
`data.num_workers` processes run on them). max_failures: how many times Ray restarts the worker group after a worker
dies (default 0); each restart resumes from the run's last.ckpt. address: the Ray cluster to join (default: the
one `ray.init()` finds, RAY_ADDRESS or a cluster started on this machine, else a new local one; an address where no
cluster listens is refused at once). Everything else is a `python train.py` override; `trainer.accelerator`,
`trainer.devices` and `trainer.num_nodes` are Ray's to set.

This process, the driver, composes the config once (the run directory is stamped here) and ships it to the
workers as plain containers; each worker runs the template's own train job (`ray_worker.py`). Why not Lightning's
Ray integration (`RayDDPStrategy`, `prepare_trainer`): prepare_trainer refuses any strategy but Ray's, and the
template builds its own (distributed/launch.py). It keeps Ray's `RayLightningEnvironment` (the ranks from
`ray.train.get_context()`, clusters.py) and Ray's process group, which Lightning finds initialised and leaves
alone (Lightning's `_init_dist_connection` returns when the group exists). `dry_run=true` plans the job for
num_workers devices here, without Ray.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from scaleup.checkpoints.io import exists
from scaleup.config.arguments import split_arguments
from scaleup.config.composition import composition_error
from scaleup.config.project import compose_project, set_up_run
from scaleup.distributed.ray_worker import last_checkpoint, train_worker
from scaleup.distributed.run_dir import register_resolvers
from scaleup.errors import (
    EXIT_USER_ERROR,
    UserError,
    as_user_error,
    new_directories,
    remove_refused_run,
    tracebacks_asked,
)

if TYPE_CHECKING:
    from scaleup.config.typed import TrainConfig

OPTIONS = {"num_workers": "1", "use_gpu": "false", "cpus_per_worker": "1", "max_failures": "0", "address": None}
SET_BY_RAY = ("trainer.accelerator", "trainer.devices", "trainer.num_nodes")


def parse(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """(Ray's options, the train overrides) from `key=value` arguments."""
    given, overrides = split_arguments(argv, OPTIONS)
    for arg in overrides:
        if arg.partition("=")[0].lstrip("+~") in SET_BY_RAY:
            raise UserError(f"{arg}: Ray Train sets it (one device per worker); pass num_workers=N use_gpu=true|false")
    if given["use_gpu"] not in ("true", "false"):
        raise UserError(f"use_gpu={given['use_gpu']} must be true or false")
    options = {"use_gpu": given["use_gpu"] == "true", "address": given["address"] or None}
    for key, least in (("num_workers", 1), ("cpus_per_worker", 1), ("max_failures", -1)):
        value = given[key]
        if not value.lstrip("-").isdigit() or int(value) < least:
            raise UserError(f"{key}={value} must be an integer >= {least}" + (" (-1: no limit)" if least < 0 else ""))
        options[key] = int(value)
    return options, overrides


def compose(overrides: list[str], accelerator: str, num_workers: int) -> DictConfig:
    """The job's config, composed once; the run directory stamped, Hydra's runtime set as `@hydra.main` sets it.
    Planned for one node of num_workers devices (each worker replaces it by where Ray put the workers)."""
    register_resolvers()
    topology = [f"trainer.accelerator={accelerator}", f"trainer.devices={num_workers}", "trainer.num_nodes=1"]
    compose_train = functools.partial(compose_project, "train")
    try:
        cfg = compose_train([*overrides, *topology])
    except Exception as err:  # a misspelled key or group option: one line naming the closest
        user_error = composition_error(err, compose_train, overrides, extra=OPTIONS, job="train")
        if user_error is None:
            raise
        raise user_error from err
    set_up_run(cfg)  # the run directory stamped once, here
    return cfg


def job_for_workers(cfg: DictConfig, accelerator: str) -> dict[str, Any]:
    """What the workers get: the job's config resolved here (the driver's run directory, paths and time, the same
    on every node) and Hydra's own, whose logging each rank resolves for itself (only rank 0 writes the log)."""
    from scaleup.config.typed import train_config

    hydra = OmegaConf.to_container(cfg.hydra, resolve=False)  # its run directory and runtime are set: compose()
    config = train_config(OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"]))
    check_job(config)
    return {"config": config.plain, "hydra": hydra, "accelerator": accelerator}


def check_job(config: TrainConfig) -> None:
    """What the workers would refuse, refused here, once: in a worker it would cost a start of Ray and its retries.
    (What needs the data, e.g. a batch larger than the training set, is still found by the workers.)"""
    from scaleup.plan.batch import resolve_batch

    # A restarted worker group resumes from the run's last.ckpt (ray_worker.py): it must be this job's.
    last = last_checkpoint(config.checkpoint.dirpath)
    if config.ckpt_path != "last" and exists(last):
        raise UserError(f"{last} is an earlier run's: resume it with ckpt_path=last, or pass another hydra.run.dir")
    if config.strategy.name != "ddp":
        # FSDP under Ray Train is not proven to give DDP's weights here; ddp_spawn would start processes in a worker.
        raise UserError(
            f"strategy={config.strategy.name} does not run under Ray Train here: use strategy=ddp, or for FSDP "
            "start torchrun on the Ray nodes (docs/clusters.md)"
        )
    batches, cap = config.batches, config.batches.max_per_device_batch_size
    resolve_batch(
        batches.global_batch_size,
        batches.per_device_batch_size,
        world_size=config.trainer.devices,
        accumulation=config.trainer.accumulate_grad_batches,
        max_per_device=cap if isinstance(cap, int) else None,  # `auto` is measured on the workers' devices
    )


def dry_run(cfg: DictConfig) -> None:
    """Plan the Ray job here, as `python train.py dry_run=true` plans one (printed and in its log): nothing starts."""
    from hydra.core.utils import configure_log

    from scaleup.train import train

    configure_log(cfg.hydra.job_logging, cfg.hydra.verbose)
    with read_write(cfg), open_dict(cfg):
        del cfg["hydra"]
    train(cfg)


def worker_resources(options: dict[str, Any]) -> dict[str, int]:
    """What Ray reserves for each worker: its CPUs (the loader's workers run on them too, and Ray sets
    OMP_NUM_THREADS to their number) and, with use_gpu, one GPU."""
    return {"CPU": options["cpus_per_worker"], **({"GPU": 1} if options["use_gpu"] else {})}


def check_resources(options: dict[str, Any]) -> None:
    """Ray would wait for ever for workers that the cluster cannot place: refuse them here."""
    import ray

    workers, cluster = options["num_workers"], ray.cluster_resources()
    for resource, each in worker_resources(options).items():
        available = int(cluster.get(resource, 0))
        if workers * each <= available:
            continue
        if available >= each:
            fix = f"num_workers={available // each}" + (" (or use_gpu=true on a GPU cluster)" * (resource == "CPU"))
        else:  # not even one worker fits
            fix = "use_gpu=false" if resource == "GPU" else f"cpus_per_worker={available}"
        raise UserError(
            f"num_workers={workers} needs {workers * each} {resource}(s) but the Ray cluster has {available}; "
            f"pass {fix}"
        )


def check_address(address: str | None) -> None:
    """ray.init retries an address where no cluster listens for many minutes, printing "Failed to connect to GCS":
    try it first, as long as Ray itself waits for one connection (RAY_gcs_rpc_server_connect_timeout_s, 5 s)."""
    given = address or os.environ.get("RAY_ADDRESS")
    host, _, port = (given or "").removeprefix("ray://").rpartition(":")
    if not host or "/" in host or not port.isdigit():  # none, auto, local, or a form Ray reads itself
        return
    timeout = float(os.environ.get("RAY_gcs_rpc_server_connect_timeout_s", 5))  # noqa: SIM112 (Ray's spelling)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as err:
        name = "address" if address else "RAY_ADDRESS"
        raise UserError(
            f"{name}={given}: no Ray cluster answers there within {timeout:g} s ({err.strerror or err}); "
            "start one with `ray start --head`, pass its head's HOST:PORT, or leave address out for a local cluster"
        ) from None


def start(job: dict[str, Any], options: dict[str, Any], run_dir: Path) -> None:
    """Start Ray's TorchTrainer on the job and wait for it; a worker's user mistake becomes a UserError."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig, WorkerGroupError
    from ray.train.torch import TorchTrainer

    ray.init(address=options["address"])
    check_resources(options)
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = TorchTrainer(
        train_worker,
        train_loop_config=job,
        scaling_config=ScalingConfig(
            num_workers=options["num_workers"],
            use_gpu=options["use_gpu"],
            resources_per_worker=worker_resources(options),
        ),
        # Ray's own records of the run (its state, not checkpoints: those are the template's) in the run directory.
        run_config=RunConfig(
            name="ray", storage_path=str(run_dir), failure_config=FailureConfig(max_failures=options["max_failures"])
        ),
    )
    try:
        trainer.fit()
    except WorkerGroupError as err:
        for failure in err.worker_failures.values():
            if (user_error := as_user_error(failure)) is not None:
                raise user_error from err
        raise
    finally:
        # Ray prints the cluster's log lines from a thread of this process, seconds late: disconnect first, so that
        # what main() prints (the error line) comes after the last of them.
        ray.shutdown()


def main(argv: list[str]) -> int:
    """0: trained (or planned), 2: a mistake in the arguments or the config, one line on stderr."""
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    created: list[Path] = []  # the run directory and its parents, where this job makes them
    try:
        options, overrides = parse(argv)
        accelerator = "gpu" if options["use_gpu"] else "cpu"
        cfg = compose(overrides, accelerator, options["num_workers"])
        run_dir = Path(cfg.hydra.runtime.output_dir)
        created = new_directories(run_dir)
        if cfg.dry_run:
            run_dir.mkdir(parents=True, exist_ok=True)
            dry_run(cfg)
            return 0
        job = job_for_workers(cfg, accelerator)
        check_address(options["address"])
        try:
            import ray  # noqa: F401
        except ImportError as err:
            raise UserError('Ray is not installed: python -m pip install -e ".[ray]" (a dry run needs no Ray)') from err
        start(job, options, run_dir)
    except Exception as err:
        user_error = as_user_error(err)
        if user_error is None or tracebacks_asked():
            raise
        remove_refused_run(created)  # what the workers wrote before they refused (plan.json, the log, Ray's records)
        print(f"error: {user_error}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    print(f"Ray Train: done, {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
