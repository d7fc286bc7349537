"""User mistakes end in one clear message and a non-zero exit, never a traceback.

Where an error comes from and what it is about decide whose it is, not its type alone:
- a `UserError` that the code raises on purpose, naming the fix;
- a config value left `???` or a broken interpolation (omegaconf);
- a file that cannot be read or written, where the engine or a library met it and it is a path of the config's;
- while objects are built from a config section (`config_errors`), the ValueError or TypeError that a library's
  constructor raises for a value.
Anything else is a bug and keeps its traceback: an error raised inside the user's own code (a file it opens among
them), and one raised by the engine's own code. A mistake in the command line's overrides that Hydra finds while it
composes the config is one line too (`scaleup.config.composition`). `HYDRA_FULL_ERROR=1` shows the traceback
behind a user error too.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
import os
import shutil
import site
import sys
import sysconfig
import tempfile
import time
import traceback
import typing
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path
from typing import Any, NoReturn

from hydra.core.hydra_config import HydraConfig
from hydra.errors import (
    InstantiationException,
)
from hydra.experimental.callback import Callback
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException


class UserError(Exception):
    """A mistake the user can fix; the message says how.

    Raised in a DataLoader worker (a corrupt shard, a dead remote, a user's transform), it reaches the main process
    rebuilt by torch from one string, `Caught UserError in DataLoader worker process 0.\nOriginal Traceback ...:
    <message>` (`torch._utils.ExceptionWrapper.reraise`): the constructor keeps only the original message, so the
    user reads one line, whatever the subclass.

    `every_rank`: every rank of the job raises it alike (the ranks agreed on it), so rank 0 alone prints it.
    """

    def __init__(self, message: str = "", *, every_rank: bool = False) -> None:
        super().__init__(worker_message(message))
        self.every_rank = every_rank


def worker_message(message: str) -> str:
    """The original message of an exception that torch re-raised from a loader worker, or `message` itself."""
    if message.startswith("Caught ") and "\nOriginal Traceback" in message:
        return message.rstrip().splitlines()[-1].split(": ", 1)[-1]
    return message


EXIT_USER_ERROR = 2


def _chain(err: BaseException | None, *, implicit: bool) -> Iterator[BaseException]:
    """`err` and the errors it was raised from (`__cause__`; with `implicit`, also `__context__`)."""
    while err is not None:
        yield err
        err = err.__cause__ or (err.__context__ if implicit else None)


def first_line(err: BaseException) -> str:
    """The first line of `err`'s message, or its type's name where it has none."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def as_user_error(err: BaseException, given: Collection[str] | None = None) -> UserError | None:
    """The user mistake behind `err`, or None when `err` is a bug.

    A UserError counts also when a library re-raised it (Hydra's instantiate wraps errors); the others only
    along explicit `raise ... from` links, so that an error raised while handling a file error stays a bug. A file
    that cannot be read or written is the user's to fix where the engine or a library met it (not the user's own
    code, which opened it) and it is one of the config's values `given` (the strings of the job's config), a folder
    above one or a file below one: where `given` is None, any.
    """
    for link in _chain(err, implicit=True):
        if isinstance(link, UserError):
            return link
    for link in _chain(err, implicit=False):
        if unused_parameters(link):
            return UserError(UNUSED_PARAMETERS)
        if isinstance(link, MissingMandatoryValue):
            key = link.full_key or link.key
            return UserError(f"{key} has no value (it is ??? in the config): pass {key}=<value>")
        if isinstance(link, OmegaConfBaseException):
            where = f" (at {link.full_key})" if link.full_key else ""
            return UserError(f"the config does not resolve{where}: {first_line(link)}")
        if isinstance(link, OSError) and link.filename is not None and a_given_path(link, given):
            return UserError(
                f"{link.filename}: {link.strerror or first_line(link)}; check that path in your overrides "
                "(a directory to write into must be creatable, a file to read must exist and be readable)"
            )
    return None


def a_given_path(err: OSError, given: Collection[str] | None) -> bool:
    """Whether the file error `err` is about a path of the config's (see `as_user_error`), not raised in the user's
    own code."""
    if opened_by_users_code(err):
        return False
    if given is None:
        return True
    path = os.path.abspath(os.fsdecode(err.filename))
    paths = [os.path.abspath(value) for value in given if value]
    return any(path == value or value.startswith(path + os.sep) or path.startswith(value + os.sep) for value in paths)


def opened_by_users_code(err: OSError) -> bool:
    """Whether the user's code met the file error `err` itself: the innermost frame of its traceback that is not a
    library's (the standard library's, an installed package's) is the user's, not the engine's."""
    frames = traceback.extract_tb(err.__traceback__)
    owners = [
        f.filename for f in frames if is_users_code(f.filename) or os.path.realpath(f.filename).startswith(ENGINE_DIR)
    ]
    return bool(owners) and is_users_code(owners[-1])


def config_strings(cfg: DictConfig) -> list[str]:
    """Every string value of the config `cfg` (resolved where it resolves): the paths a job may read or write."""
    try:
        tree = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException:
        tree = OmegaConf.to_container(cfg, resolve=False)
    found, nodes = [], [tree]
    while nodes:
        node = nodes.pop()
        if isinstance(node, dict):
            nodes += node.values()
        elif isinstance(node, list):
            nodes += node
        elif isinstance(node, str):
            found.append(node)
    return found


# What DDP's reducer says when a backward leaves some parameters without a gradient (torch 2.14), and what Lightning
# 2.6's DDPStrategy puts in its place: advice on Lightning's own strategy names, which the template's config refuses.
REDUCER_MESSAGES = (
    "Expected to have finished reduction in the prior iteration",
    "has parameters that were not used in producing the loss",
)
# The Python frames that call into the reducer: DDP's forward, and Lightning's `prepare_for_backward` (manual_backward).
REDUCER_CALLERS = ("torch/nn/parallel/distributed.py", "lightning/pytorch/overrides/distributed.py")
UNUSED_PARAMETERS = (
    "DDP found parameters that got no gradient from a training step's loss (e.g. a GAN's discriminator loss, "
    "which leaves out the generator): set strategy.find_unused_parameters=true (DDP then looks for them in each "
    "backward's graph), or make every parameter take part in every loss. Under manual optimization also run each "
    "optimizer's part of training_step in `with self.toggled_optimizer(opt):` so that its backward reaches only "
    "that optimizer's parameters: a backward that reaches them all (the generator's loss, through the "
    "discriminator) makes torch warn that it found no unused parameters"
)


def unused_parameters(err: BaseException) -> bool:
    """Whether `err` is DDP's reducer refusing a backward that left parameters without a gradient: raised from the
    reducer's Python caller (not a user's own error that happens to quote the message)."""
    frames = traceback.extract_tb(err.__traceback__)
    return (
        isinstance(err, RuntimeError)
        and any(message in str(err) for message in REDUCER_MESSAGES)
        and bool(frames)
        and frames[-1].filename.replace(os.sep, "/").endswith(REDUCER_CALLERS)
    )


@contextlib.contextmanager
def config_errors(section: str) -> Iterator[None]:
    """Errors raised while building objects from the config section `section` are mistakes in that section.

    A ValueError or TypeError that a library's or the engine's constructor raises for a value (an optimizer's
    negative LR, a Trainer argument), also when Hydra's instantiate wraps it, and Lightning's
    MisconfigurationException become `section: <message>`. One raised inside the user's own code is a bug there
    and keeps its traceback: its arguments were checked against the constructor's signature and hints before
    the call (config/schema.py); so is one raised in the engine's own code (a call it made wrong).
    """
    try:
        yield
    except Exception as err:
        if as_user_error(err) is not None:
            raise
        cause = err.__cause__ if isinstance(err, InstantiationException) and err.__cause__ is not None else err
        if isinstance(cause, ValueError | TypeError | MisconfigurationException) and raised_in_a_library(cause):
            raise UserError(f"{section}: {first_line(cause)}") from err
        raise


# The engine's own package, and where installed code lives (the standard library, site-packages) besides it: code
# outside them is the user's (their project's package, its entry points, a test's modules).
ENGINE_DIR = str(Path(__file__).resolve().parent) + os.sep
LIBRARY_DIRS = tuple(
    os.path.realpath(path) + os.sep
    for path in {
        *(sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")),
        *site.getsitepackages(),
        ENGINE_DIR,
    }
)


def is_users_code(filename: str) -> bool:
    """Whether the source file `filename` is the user's code, not installed code nor the engine's."""
    return bool(filename) and not filename.startswith("<") and not os.path.realpath(filename).startswith(LIBRARY_DIRS)


def raised_in_users_code(err: BaseException) -> bool:
    """Whether `err` was raised while the user's code ran (a frame of its traceback is in the user's code)."""
    return any(is_users_code(frame.filename) for frame in traceback.extract_tb(err.__traceback__))


def raised_in_a_library(err: BaseException) -> bool:
    """Whether `err` was raised by installed code that the engine called: its innermost frame is neither the
    engine's (a call the engine made wrong fails there) nor the user's, and no frame runs the user's code."""
    frames = traceback.extract_tb(err.__traceback__)
    return (
        bool(frames)
        and not raised_in_users_code(err)
        and not os.path.realpath(frames[-1].filename).startswith(ENGINE_DIR)
    )


# Set in a search's trial, by the search (hydra.job.env_set in each trial's overrides, search/trial.py).
SEARCH_TRIAL = "SCALEUP_SEARCH_TRIAL"


def in_search() -> bool:
    """Whether this job is a search's trial."""
    return os.environ.get(SEARCH_TRIAL) == "1"


def exit_on_user_error(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a user mistake raised by a job into `error: <message>` on stderr and exit code 2. In a search's trial, the
    mistake is raised for the launcher to return as the trial's failure: the search records the trial as failed and
    stops with it (search/runner.py); an exit would leave the trial running in the study, resumed by every rerun."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            config = args[0] if args and isinstance(args[0], DictConfig) else None
            user_error = as_user_error(err, None if config is None else config_strings(config))
            if user_error is None or tracebacks_asked():
                raise
            if in_search():
                raise user_error from err
            remove_refused_hydra_run()
            exit_with(user_error)

    return wrapper


# torchrun's agent names, in each of its workers, the file where a worker records why it failed; it reads the file
# back into its summary (torch.distributed.elastic.multiprocessing.errors.ProcessFailure: a message and a timestamp).
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"


def exit_with(user_error: UserError) -> NoReturn:
    """`error: <message>` on stderr and exit code 2. In a torchrun job, where every rank finds the same mistake in the
    same config, or where the ranks agreed on it (`every_rank`), only rank 0 prints it; each torchrun worker records
    its line for torchrun's agent, whose summary (and the engine's wrapper, distributed/torchrun.py) shows another
    rank's where it differs."""
    line = f"error: {user_error}"
    said_by_rank_0 = record_for_launcher(line) or user_error.every_rank
    rank = int(os.environ["RANK"]) if "RANK" in os.environ else rank_zero_only.rank  # torchrun's, or Lightning's
    if not said_by_rank_0 or rank == 0:
        print(line, file=sys.stderr, flush=True)
    sys.exit(EXIT_USER_ERROR)


def record_for_launcher(message: str) -> bool:
    """In a torchrun worker, record why it fails in the file its agent names, for the agent's summary (which names the
    failure that recorded first as the root cause): the worker's own error, not a peer's. Whether there is one."""
    if (error_file := os.environ.get(ERROR_FILE)) is None:
        return False
    Path(error_file).write_text(json.dumps({"message": message, "timestamp": int(time.time())}))
    return True


def did_you_mean(word: str, known: Iterable[str], prefix: str = "") -> str:
    """`; did you mean <prefix><closest>?` for the known word closest to `word`, or "" when none is close."""
    match = difflib.get_close_matches(word, [str(k) for k in known], n=1)
    return f"; did you mean {prefix}{match[0]}?" if match else ""


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def already_in_config(added: str) -> str:
    """Why the override `+key=VALUE` adds nothing: the config holds `key`, which `key=VALUE` sets."""
    key, fixed = override_key(added), added.removeprefix("+")
    return f"{added}: {key} is already in the config; set it with {fixed} (a leading + adds a new key)"


FULL_ERROR = "HYDRA_FULL_ERROR"  # "1": the user asks for the traceback behind an error (also Hydra's)


def tracebacks_asked() -> bool:
    """Whether the user set HYDRA_FULL_ERROR=1 to see the traceback behind a user error too."""
    return os.environ.get(FULL_ERROR) == "1"


def new_directories(path: Path) -> list[Path]:
    """The directories that creating `path` would make: `path` and its missing parents, deepest first."""
    path = Path(os.path.abspath(path))
    return [directory for directory in (path, *path.parents) if not directory.exists()]


def why_unwritable(directory: str | Path) -> OSError | None:
    """Why a run could not write into `directory` (creating it and its missing parents where they are not there), or
    None where it can. Asked of its nearest existing ancestor with a scratch directory made and removed there: a
    read-only or special file system (/proc), a missing permission or a file in the way is found without leaving
    anything behind, whatever number of processes ask at once."""
    path = Path(os.path.abspath(directory))
    existing = next(folder for folder in (path, *path.parents) if folder.exists())
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".scaleup-", dir=existing))
    except OSError as err:
        return err
    return None


def remove_refused_run(created: list[Path]) -> None:
    """A refused run leaves nothing behind: remove the run directory it made (`created`, from `new_directories`)
    with what Hydra and the job wrote there (`.hydra/`, the log, plan.json, config.yaml), and the parents it made
    while they are empty. A directory that holds a checkpoint stays, and one whose run started and failed (its
    failure.json says why, e.g. a NaN loss); one that existed before is not in `created`."""
    if not created or any(path.name.endswith(".ckpt") or path.name == "failure.json" for path in created[0].rglob("*")):
        return
    shutil.rmtree(created[0], ignore_errors=True)
    for parent in created[1:]:
        with contextlib.suppress(OSError):  # not empty: another run made its own directory there meanwhile
            parent.rmdir()


def remove_refused_hydra_run() -> None:
    """After a user error in a Hydra job: `remove_refused_run` on what RunDirCheck saw this run make (a sweep's job
    directories are not among them: `SweepCheck` refuses before any is made)."""
    created, RunDirCheck.created = RunDirCheck.created, []
    output_dir = OmegaConf.select(HydraConfig.get(), "runtime.output_dir") if HydraConfig.initialized() else None
    if created and str(created[0]) == output_dir:
        remove_refused_run(created)


class RunDirCheck(Callback):
    """Hydra creates the run directory before the job starts, outside `exit_on_user_error`: a directory that
    cannot be created (`hydra.run.dir=/read-only/path`) would end in Hydra's traceback. Create it here first, and
    note what this run made (`created`), for `exit_on_user_error` to remove when the job refuses to run."""

    created: typing.ClassVar[list[Path]] = []

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        directory = config.hydra.run.dir
        RunDirCheck.created = new_directories(directory)
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            print(
                f"error: cannot create the run directory {directory}: {err.strerror or err}; "
                "pass hydra.run.dir=<a directory you can write> (or fix paths.log_dir)",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(EXIT_USER_ERROR)
