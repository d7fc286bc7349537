"""Shared helpers: run the jobs in this process or the real entry points as subprocesses, read what a run leaves on
disk.

Every run trains the suite's own project, engine/tests/project/ (its package `testbed`, its configs/, its train.py,
eval.py and export.py), never the example a user replaces; every test starts in that folder, as a user runs the
commands in theirs. Two ways to run a job, with the same `key=value` overrides a user would type:
- `in_process(args, job="train"|"eval"|"export")`: composes configs/<job>.yaml with Hydra's compose API and calls
  the job function (`scaleup.train.train` ...) here, with `HydraConfig.get()` set up as `@hydra.main` would and the
  run's log file written. No interpreter start (~4 s saved per run). A user mistake raises `UserError` (the entry
  point would print it and exit 2). Use it for every single-process run.
- `run(args, script="train.py")`: the entry point in a process of its own, forked from a server that has imported
  torch and Lightning once (engine/tests/preloaded.py: ~5 s of CPU saved per run; the processes a run starts itself are
  fresh interpreters). Use it where processes matter: more than one process (a `strategy="ddp"` Trainer in pytest
  would re-run pytest), launchers, signals, kill -9, and the exit code and message of the entry point itself.
  `start(command)` is the same in the background.
Both take `hydra.run.dir=DIR` among the overrides; give one, or the run lands in the project's outputs/ (ignored by
git).
"""

from __future__ import annotations

import functools
import json
import math
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from preloaded import STARTUP_VARIABLES

if TYPE_CHECKING:
    import torch

# torch, Hydra and the template are imported where they are used: pytest's controlling process loads this file
# too, and imports nothing heavy before it starts the workers.

ROOT = Path(__file__).resolve().parents[2]  # the repository: the example project, with the engine in engine/
TESTS = Path(__file__).resolve().parent
# The suite's own project (its package `testbed`, its configs, its entry points): what every run here trains, so that
# the engine's tests never depend on the example a user replaces.
PROJECT = TESTS / "project"
sys.path.insert(0, str(PROJECT))  # `testbed` for the runs in this process (the entry points find it beside them)
ENGINE_CONF = ROOT / "engine" / "src" / "scaleup" / "conf"  # the engine's groups (pkg://scaleup.conf)
CONFIG_DIRS = (PROJECT / "configs", ENGINE_CONF)  # the project's top configs and groups, then the engine's


def config_groups(config_dirs: tuple[Path, ...] = CONFIG_DIRS) -> dict[str, list[Path]]:
    """Every config group (a folder such as `model/optimizer`, in the project's configs or the engine's) -> its
    option files (a `_`-named file is a part its options share, no option of its own)."""
    return {
        str(folder.relative_to(root)): sorted(path for path in folder.glob("*.yaml") if path.stem[:1] != "_")
        for root in config_dirs
        for folder in sorted(root.glob("**/"))
        if folder != root and any(folder.glob("*.yaml"))
    }


def engine_option(option: str, **overrides: Any) -> dict[str, Any]:
    """An engine config option as its YAML file holds it (`lr_schedule/linear`, `trainer/default`), with `overrides`:
    what a test does not set is what a run gets, from the one place that states it (a shared part its `defaults`
    names, `strategy/_base`, included)."""
    from scaleup.conf import MADE, group_values

    if option in MADE:
        return group_values(option) | overrides
    tree = yaml.safe_load((ENGINE_CONF / f"{option}.yaml").read_text()) or {}
    group = option.rpartition("/")[0]
    shared = [entry for entry in tree.pop("defaults", None) or [] if isinstance(entry, str) and entry[:1] == "_"]
    parts = [engine_option(f"{group}/{entry}") for entry in shared if entry != "_self_"]
    return {key: value for part in parts for key, value in part.items()} | tree | overrides


def engine_section(option: str, **overrides: Any) -> Any:
    """An engine config option as the typed record a run reads (`trainer/default` -> its TrainerArgs), with
    `overrides`."""
    from scaleup.config.schema import SECTIONS
    from scaleup.config.typed import section

    return section(SECTIONS["train"][option.split("/")[0]], engine_option(option, **overrides))


def batches(**values: Any) -> Any:
    """The batch keys of the `data` section as the plan reads them: the test project's digits, with `values`."""
    from scaleup.config.schema import DataBatches
    from scaleup.config.typed import section

    digits = yaml.safe_load((PROJECT / "configs" / "data" / "digits.yaml").read_text())
    return section(DataBatches, {key: digits[key] for key in DataBatches.model_fields} | values)


def performance() -> Any:
    """The `performance` section as a run has it (the test project's configs/train.yaml)."""
    from scaleup.config.schema import Performance
    from scaleup.config.typed import section

    return section(Performance, yaml.safe_load((PROJECT / "configs" / "train.yaml").read_text())["performance"])


# A short run: 2 epochs of digits, no progress bar, no model summary.
QUICK = [
    "trainer.max_epochs=2",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "trainer.num_sanity_val_steps=0",
]

# The float64 runs behind the equivalence and resume guarantees. float32 results differ between CPUs (rounding
# depends on the kernels, and training amplifies it), so weights are compared in float64, to TOLERANCE (absolute).
# With randomness on: dropout 0.5 and a random shift and rotation of every training image, both drawn by
# (seed, step or epoch, position), never by rank or worker (data/seeding.py). Dropout masks are drawn per
# micro-batch, so every topology runs micro-batches of 32: the cap splits the global batch of 64 into 2 x 32 on
# one device, and does not bite on two. AdamW (stateful) and a warmup that ramps (base batch 32: peak = 2 x base,
# over epochs 0 and 1), so that a resume must restore the optimizer's moments and a ramping LR exactly.
# GroupNorm: nothing in the model depends on how the global batch is split. 513 training samples leave 8 global
# batches of 64 per epoch (one sample short of a ninth): 24 optimizer steps in 3 epochs, warmup the first 16.
# val 129 -> 2 ranks get 65/64 samples = 3/2 batches of 32 (one rank a batch short); test 1155 -> 578/577.
EXACT = [
    *QUICK,
    "trainer.max_epochs=3",
    "trainer.precision=64-true",
    "model.net.norm=group",
    "model.net.dropout=0.5",
    "data.augment=true",
    "data.max_per_device_batch_size=32",
    "model/optimizer=adamw",
    "lr_schedule.base_batch_size=32",
    "lr_schedule.warmup_epochs=2",
    "data.val_size=129",
    "data.test_size=1155",
    "trainer.log_every_n_steps=1",
]
EXACT_TRAIN, EXACT_VAL, EXACT_TEST, EXACT_STEPS_PER_EPOCH, EXACT_EPOCHS = 513, 129, 1155, 8, 3
EXACT_WARMUP_STEPS = 16
LR_TAG = "lr-AdamW/decay"  # the logged LR of the param group with weight decay
TOLERANCE = 1e-10
# Every topology with micro-batches of 32. "two" also loads with 2 workers per rank (the others in the main
# process): augmentation must not depend on who loads a sample.
TOPOLOGIES = {
    "one": ["trainer.devices=1"],  # accumulation 2, derived from the cap
    "two": ["trainer.devices=2", "data.num_workers=2"],
    "accum": ["trainer.devices=1", "trainer.accumulate_grad_batches=2"],  # the same, set by hand
}
# The same recipe at a global batch of 192 in micro-batches of 16: 2 steps per epoch, 6 in all, on 1 device
# (accumulation 12), 3 devices (4) or 4 devices (3): the same micro-batches everywhere.
WIDE = [*EXACT, "data.global_batch_size=192", "data.max_per_device_batch_size=16"]


def warmup_cosine(step: int, base: float, peak: float, warmup: int, total: int) -> float:
    """The LR the plan promises at an optimizer step, written out here rather than taken from LRSchedule: a linear
    ramp from the base LR (step 0) to the peak (step `warmup`), then a half cosine from the peak to 0 (step `total`)."""
    if step < warmup:
        return base + (peak - base) * step / warmup
    return peak * (1 + math.cos(math.pi * (step - warmup) / (total - warmup))) / 2


# The files that take longest (multi-process runs), longest first, collected before all others: the 2 workers,
# each taking whole files as it frees up (`--dist loadfile`), then end at about the same time, instead of one
# starting a long file while the other has nothing left. Order by each file's total, measured on a 2-core machine.
LONGEST_FILES = (
    "test_fsdp.py",
    "test_search.py",
    "test_ray.py",
    "test_launchers.py",
    "test_shards.py",
    "test_copier.py",
    "test_elastic.py",
    "test_resume.py",
    "test_rank_failures.py",
    "test_errors.py",
    "test_preemption.py",
    "test_notebooks.py",
    "test_finetune.py",
    "test_project.py",
    "test_ddp.py",
    "test_any_device_count.py",
    "test_config.py",
    "test_kubernetes.py",
    "test_randomness.py",
    "test_plain_logging.py",
    "test_manual_optimization.py",
    "test_step_time.py",
    "test_train_e2e.py",
)


@pytest.fixture(autouse=True)
def in_the_project(monkeypatch) -> None:
    """Every test starts in the suite's project folder, where a user runs the commands (`python -m
    scaleup.data.convert` and the other module entry points find configs/ there)."""
    monkeypatch.chdir(PROJECT)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))  # stable: files keep their order


# Variables a parent launcher may have left behind; a stray LOCAL_RANK makes Lightning wait for ranks that never come.
LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("SLURM_")}
    # engine/tests/probes.py and the project's `testbed`, for processes that do not start beside them (torchrun, Ray)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(PROJECT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"  # keep 2-process runs from fighting over the 2 cores
    env.update(extra)
    return env


def merged(args: list[str]) -> list[str]:
    """Overrides with repeated keys collapsed, the last one winning (Hydra itself would not say which wins)."""
    by_key = {arg.split("=", 1)[0]: arg for arg in args}
    return list(by_key.values())


class PreloadedProcess:
    """A run forked by engine/tests/preloaded.py, with the part of Popen's interface the tests use."""

    def __init__(self, args: list[str], conn: Any, stdout: Any = None) -> None:
        self.args, self.stdout, self.returncode = args, stdout, None
        self._conn = conn
        self.pid = int(conn.recv(64))

    def _answer(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                self.returncode = int(self._conn.recv(64))
            except (BlockingIOError, TimeoutError):
                return None
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        return self._answer(0)

    def wait(self, timeout: float | None = None) -> int:
        if self._answer(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str | None, None]:
        output = self.stdout.read() if self.stdout else None
        self.wait(timeout)
        return output, None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_SERVER_STARTING = threading.Lock()  # a test may start runs from threads, to run them side by side


def _preloaded_server() -> tuple[subprocess.Popen, str]:
    """This worker's engine/tests/preloaded.py, started on first use; it exits with the worker (its stdin closes)."""
    with _SERVER_STARTING:
        return _start_preloaded_server()


@functools.cache
def _start_preloaded_server() -> tuple[subprocess.Popen, str]:
    import tempfile

    path = os.path.join(tempfile.mkdtemp(prefix="preloaded-"), "socket")
    server = subprocess.Popen(
        [sys.executable, str(TESTS / "preloaded.py"), path],
        cwd=ROOT,
        env=clean_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout.readline() == "ready\n", "engine/tests/preloaded.py did not start"
    return server, path


def _preloadable(command: list[str], env: dict[str, str]) -> bool:
    """A `python <script>.py ...` or `python -m <module> ...` of this interpreter, in the environment it starts in."""
    served = clean_env()
    return (
        command[0] == sys.executable
        and (command[1].endswith(".py") or command[1] == "-m")
        and all(env.get(name) == served.get(name) for name in STARTUP_VARIABLES)
    )


def _fork(command: list[str], cwd: Path, env: dict[str, str], streams: tuple[int, int, int]) -> Any:
    """Ask the preloaded server to run `command`; returns the connection that answers with the pid and exit code."""
    import socket

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(_preloaded_server()[1])
    request = {"argv": command[1:], "cwd": str(cwd), "env": env}
    socket.send_fds(conn, [json.dumps(request).encode()], list(streams))
    return conn


def run(
    args: list[str],
    *,
    script: str = "train.py",
    timeout: float = 300,
    env: dict[str, str] | None = None,
    cwd: Path = PROJECT,
) -> subprocess.CompletedProcess:
    """Run an entry point of the suite's project the way a user would: from its folder, or from `cwd` (then outputs/
    lands there).

    The process is forked from a server that has imported torch and Lightning already (engine/tests/preloaded.py)."""
    return run_command([sys.executable, str(PROJECT / script), *merged(args)], timeout=timeout, env=env, cwd=cwd)


def run_command(
    command: list[str], *, timeout: float = 300, env: dict[str, str] | None = None, cwd: Path = PROJECT
) -> subprocess.CompletedProcess:
    """`command` to its end, its output captured: forked from the preloaded server where it is `python <script>.py`
    or `python -m <module>` (see `run`), otherwise a subprocess."""
    import tempfile

    env = env or clean_env()
    if not _preloadable(command, env):
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err, open(os.devnull) as stdin:
        proc = PreloadedProcess(command, _fork(command, cwd, env, (stdin.fileno(), out.fileno(), err.fileno())))
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command, proc.returncode, out.read(), err.read())


def in_process(args: list[str], *, job: str = "train") -> Any:
    """Run `python <job>.py *args` in this process: `scaleup.testing.run_job` from the suite's project (Hydra's
    runtime set up as `@hydra.main` sets it, the run's log file written, torch on one thread as the subprocesses).
    Returns what the job returns (`train`/`eval`: the final metrics). A user mistake raises `UserError`."""
    from scaleup.testing import run_job

    sigterm = signal.getsignal(signal.SIGTERM)
    result = run_job(job, args, project=PROJECT)  # run_job merges repeated keys, the last one winning
    # A job leaves the process's SIGTERM handler as it found it (processes forked later must still die on it).
    assert signal.getsignal(signal.SIGTERM) == sigterm, f"{job} left SIGTERM to {signal.getsignal(signal.SIGTERM)}"
    return result


def start(command: list[str], env: dict[str, str] | None = None, cwd: Path = PROJECT, log: Path | None = None) -> Any:
    """Start a command (from the suite's project, or `cwd`) in the background, stdout and stderr merged into a pipe, or
    appended to the file `log` (a pipe nobody reads while the test waits could fill and stall the process); a
    Popen, or for `python <script>.py ...` and `python -m <module> ...` the same run forked from the preloaded server
    (see `run`)."""
    env = env or clean_env()
    with open(log or os.devnull, "a") as out:
        if not _preloadable(command, env):
            output = out if log else subprocess.PIPE
            return subprocess.Popen(command, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT, text=True)
        read, write = (None, out.fileno()) if log else os.pipe()
        with open(os.devnull) as stdin:
            conn = _fork(command, cwd, env, (stdin.fileno(), write, write))
    if not log:
        os.close(write)
    return PreloadedProcess(command, conn, None if log else open(read))


def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def files_written(run_dir: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under `run_dir` (sharded checkpoints' shards too) with its modification time and contents; not the
    job's log or Hydra's record of the command line (`.hydra/`), which every start writes."""
    return {
        str(path.relative_to(run_dir)): (path.stat().st_mtime_ns, path.read_bytes())
        for path in sorted(run_dir.rglob("*"))
        if path.is_file() and path.suffix != ".log" and ".hydra" not in path.relative_to(run_dir).parts
    }


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    import torch

    return torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]


def assert_same_weights(a: dict, b: dict, rtol: float, atol: float) -> float:
    """Assert two state_dicts match; return the largest absolute difference."""
    import torch

    assert a.keys() == b.keys()
    worst = 0.0
    for key in a:
        if a[key].is_floating_point():
            torch.testing.assert_close(a[key], b[key], rtol=rtol, atol=atol, msg=lambda m, key=key: f"{key}: {m}")
            worst = max(worst, (a[key] - b[key]).abs().max().item())
        else:
            assert torch.equal(a[key], b[key]), key
    return worst


def kill_writer_at_random(
    write_forever: Callable[[Path, Any], None], path: Path, max_delay: float, trials: int = 10
) -> Iterator[int]:
    """Fork `write_forever(path, saved_once)` (a process that saves checkpoints to `path` in a loop and sets the
    event after its first complete save), SIGKILL it at a random moment of the saves that follow, `trials` times:
    yields the trial number after each kill, for the caller to check what the kill left at `path`."""
    fork = multiprocessing.get_context("fork")  # the writer starts without importing torch again
    rng = random.Random(1)
    for trial in range(trials):
        saved_once = fork.Event()
        writer = fork.Process(target=write_forever, args=(path, saved_once), daemon=True)
        writer.start()
        assert saved_once.wait(60)  # one complete save, then kill somewhere in the following ones
        time.sleep(rng.uniform(0.0, max_delay))
        writer.kill()
        writer.join()
        yield trial


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[Any]:
    """A local S3 endpoint (tests/s3_server.py: moto's server, counting what it serves) for the whole session (one
    per xdist worker), holding the bucket `bucket`; stopped at the session's end. Tests take `s3`."""
    import s3fs
    from s3_server import S3Endpoint

    endpoint = S3Endpoint().start()
    with pytest.MonkeyPatch.context() as env:
        for key, value in endpoint.env.items():
            env.setenv(key, value)
        s3fs.S3FileSystem().mkdir("bucket")
    yield endpoint
    endpoint.stop()


@pytest.fixture
def s3(s3_endpoint, monkeypatch) -> Iterator[Any]:
    """The session's S3 endpoint with its counters zeroed and no fault pending, and the environment set as a user
    sets it to reach an S3-compatible endpoint (AWS_ENDPOINT_URL and a key). botocore's own retries are off
    (AWS_MAX_ATTEMPTS=1): a fault reaches the template's retries, and every request shows in the counts."""
    for key, value in s3_endpoint.env.items():
        monkeypatch.setenv(key, value)
    s3_endpoint.reset()
    yield s3_endpoint
    s3_endpoint.reset()


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """The directory `name`, filled by `make(directory)` once for the whole test session, however many xdist
    workers ask for it: the first one makes it under a file lock, the others wait for it and read it. (A session
    fixture alone runs once per worker, repeating the same training run on each.) Tests only read it."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's directory, above each worker's own
    directory, done = root / "made_once" / name, root / "made_once" / f"{name}.done"
    directory.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{directory}.lock"):
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)  # what a failed attempt left
            make(directory)
            done.touch()
    return directory


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """One default-config training run (12 epochs of digits, ~10 s), shared by the end-to-end tests; what it printed
    (stdout, then stderr) is in `printed(trained_run)`, beside the run directory."""

    def train(run_dir: Path) -> None:
        result = check(run(["trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}"]))
        printed(run_dir).write_text(result.stdout + result.stderr)

    return made_once(tmp_path_factory, "trained", train)


def printed(run_dir: Path) -> Path:
    """The file holding what the run in `run_dir` printed (trained_run's), beside the run directory: nothing in the
    run directory but what the run itself writes."""
    return run_dir.with_name(f"{run_dir.name}.printed")


@pytest.fixture(scope="session")
def wide_reference(tmp_path_factory) -> Path:
    """The WIDE recipe on 1 process: what its 3-process (test_randomness), 2 x 2 torchrun (test_launchers) and
    2-process FSDP (test_fsdp, resumed from steps/at-3.ckpt: the middle of epoch 1) runs must end with."""
    return made_once(
        tmp_path_factory,
        "wide",
        lambda run_dir: in_process([*WIDE, "trainer.devices=1", *save_every("at3", 3), f"hydra.run.dir={run_dir}"]),
    )


def save_every(name: str, steps: int, dirpath: str = "${hydra:runtime.output_dir}/steps") -> list[str]:
    """Overrides for an extra ModelCheckpoint `callbacks.<name>` that writes `at-<N>.ckpt` every `steps` optimizer
    steps, also in the middle of an epoch."""
    return [
        f"+callbacks.{name}._target_=lightning.pytorch.callbacks.ModelCheckpoint",
        f"+callbacks.{name}.dirpath={dirpath}",
        f"+callbacks.{name}.every_n_train_steps={steps}",
        f"+callbacks.{name}.save_top_k=-1",
        f"+callbacks.{name}.filename='at-{{step}}'",
        f"+callbacks.{name}.auto_insert_metric_name=false",  # at-13.ckpt: no "=" in the path, Hydra-friendly
    ]


@pytest.fixture(scope="session")
def baseline(tmp_path_factory) -> Callable[[str], Path]:
    """`baseline(name)`: the run directory of one uninterrupted EXACT run on TOPOLOGIES[name], made on first use.

    One run per topology serves the equivalence tests (1 vs 2 processes vs accumulation), the resume tests
    (a resumed run must end with the same weights and LR curve) and the LR-curve tests. Each run records what
    every rank saw under probe/ (engine/tests/probes.py RankProbe). The 2-process run also holds 1 GiB on rank 1
    (probes.MemoryHog), which changes no number but must show in the uneven-memory warning, and saves mid-run
    checkpoints for the resume tests: steps/at-13.ckpt (5 of epoch 1's 8 steps, in the warmup) and
    steps/at-16.ckpt (the last batch of epoch 1). "one" and "accum" run in this process; "two" runs
    `python train.py trainer.devices=2` with Lightning's launcher, which starts the second process, and names its
    own run directory (under paths.log_dir): the Lightning-launcher test in test_launchers checks that both
    processes found the same one.
    """
    probe = ["+callbacks.probe._target_=probes.RankProbe", "+callbacks.probe.out_dir=${hydra:runtime.output_dir}/probe"]

    def make(name: str, directory: Path) -> None:
        args = [*EXACT, *TOPOLOGIES[name], *probe]
        if name == "two":
            hog = ["+callbacks.hog._target_=probes.MemoryHog", "+callbacks.hog.rank=1"]
            steps = [*save_every("at13", 13), *save_every("at16", 16)]
            check(run([*args, *hog, *steps, f"paths.log_dir={directory}"]))
        else:
            in_process([*args, f"hydra.run.dir={directory}"])

    def get(name: str) -> Path:
        directory = made_once(tmp_path_factory, f"baseline-{name}", functools.partial(make, name))
        if name == "two":  # the run directory the launched processes named, under paths.log_dir
            (directory,) = (directory / "train").iterdir()
        return directory

    return get


def scalars(run_dir: Path, tag: str) -> dict[int, float]:
    """{step: value} of a scalar the run logged to TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


def training_epochs(run_dir: Path) -> dict[str, dict[int, float]]:
    """The training epochs' figures the run logged ({step at the epoch's end: value}): loss, samples, accuracy."""
    return {tag: scalars(run_dir, f"train/{tag}") for tag in ("loss", "samples", "acc")}
