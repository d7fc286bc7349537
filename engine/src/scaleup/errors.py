"""User mistakes end in one clear message and a non-zero exit, never a traceback.

Two kinds of error count as the user's:
- a `UserError` that the code raises on purpose, naming the fix;
- an error that says the user's input is wrong wherever it is raised: a config value left `???` or a broken
  interpolation (omegaconf), a path that cannot be read or written (an OSError naming a file), and, while
  objects are built from a config section (`config_errors`), the ValueError or TypeError that a library's or the
  engine's constructor raises for a bad value.
Anything else is a bug and keeps its traceback: an exception raised inside the user's own code among them.
`HYDRA_FULL_ERROR=1` shows the traceback behind a user error too.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.util
import os
import shutil
import site
import sys
import sysconfig
import tempfile
import traceback
import typing
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.errors import (
    ConfigCompositionException,
    InstantiationException,
    MissingConfigException,
    OverrideParseException,
)
from hydra.experimental.callback import Callback
from lightning.fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException


class UserError(Exception):
    """A mistake the user can fix; the message says how.

    Raised in a DataLoader worker (a corrupt shard, a dead remote, a user's transform), it reaches the main process
    rebuilt by torch from one string, `Caught UserError in DataLoader worker process 0.\nOriginal Traceback ...:
    <message>` (`torch._utils.ExceptionWrapper.reraise`): the constructor keeps only the original message, so the
    user reads one line, whatever the subclass.
    """

    def __init__(self, message: str = "") -> None:
        super().__init__(worker_message(message))


def worker_message(message: str) -> str:
    """The original message of an exception that torch re-raised from a loader worker, or `message` itself."""
    if message.startswith("Caught ") and "\nOriginal Traceback" in message:
        return message.rstrip().splitlines()[-1].split(": ", 1)[-1]
    return message


EXIT_USER_ERROR = 2
GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic"  # how Hydra reads a command line's overrides


def _chain(err: BaseException | None, *, implicit: bool) -> Iterator[BaseException]:
    """`err` and the errors it was raised from (`__cause__`; with `implicit`, also `__context__`)."""
    while err is not None:
        yield err
        err = err.__cause__ or (err.__context__ if implicit else None)


def first_line(err: BaseException) -> str:
    """The first line of `err`'s message, or its type's name where it has none."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def as_user_error(err: BaseException) -> UserError | None:
    """The user mistake behind `err`, or None when `err` is a bug.

    A UserError counts also when a library re-raised it (Hydra's instantiate wraps errors); the others only
    along explicit `raise ... from` links, so that an error raised while handling a file error stays a bug.
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
        if isinstance(link, OSError) and link.filename is not None:
            return UserError(
                f"{link.filename}: {link.strerror or first_line(link)}; check that path in your overrides "
                "(a directory to write into must be creatable, a file to read must exist and be readable)"
            )
    return None


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
    "which leaves out the generator): set strategy.find_unused_parameters=true (DDP then finds them in each "
    "step's graph), or make every parameter take part in every loss"
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
    the call (config/schema.py).
    """
    try:
        yield
    except Exception as err:
        if as_user_error(err) is not None:
            raise
        cause = err.__cause__ if isinstance(err, InstantiationException) and err.__cause__ is not None else err
        if isinstance(cause, ValueError | TypeError | MisconfigurationException) and not raised_in_users_code(cause):
            raise UserError(f"{section}: {first_line(cause)}") from err
        raise


# Where installed code lives (the standard library, site-packages) and the engine's own package: code outside
# them is the user's (their project's package, its entry points, a test's modules).
LIBRARY_DIRS = tuple(
    os.path.realpath(path) + os.sep
    for path in {
        *(sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")),
        *site.getsitepackages(),
        str(Path(__file__).resolve().parent),
    }
)


def is_users_code(filename: str) -> bool:
    """Whether the source file `filename` is the user's code, not installed code nor the engine's."""
    return bool(filename) and not filename.startswith("<") and not os.path.realpath(filename).startswith(LIBRARY_DIRS)


def raised_in_users_code(err: BaseException) -> bool:
    """Whether `err` was raised while the user's code ran (a frame of its traceback is in the user's code)."""
    return any(is_users_code(frame.filename) for frame in traceback.extract_tb(err.__traceback__))


def exit_on_user_error(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a user mistake raised by a job into `error: <message>` on stderr and exit code 2. In a search's trial, the
    mistake is raised for the launcher to return as the trial's failure: the search records the trial as failed and
    stops with it (search/runner.py); an exit would leave the trial running in the study, resumed by every rerun."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from scaleup.search.trial import in_search  # it imports Lightning

        try:
            return fn(*args, **kwargs)
        except Exception as err:
            user_error = as_user_error(err)
            if user_error is None or tracebacks_asked():
                raise
            if in_search():
                raise user_error from err
            remove_refused_hydra_run()
            print(f"error: {user_error}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)

    return wrapper


def did_you_mean(word: str, known: Iterable[str], prefix: str = "") -> str:
    """`; did you mean <prefix><closest>?` for the known word closest to `word`, or "" when none is close."""
    match = difflib.get_close_matches(word, [str(k) for k in known], n=1)
    return f"; did you mean {prefix}{match[0]}?" if match else ""


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def composition_error(
    err: BaseException,
    compose: Callable[[list[str]], DictConfig],
    overrides: list[str],
    extra: Iterable[str] = (),
    job: str | None = None,
) -> UserError | None:
    """The user mistake behind Hydra's composition error `err`, in one line with the closest match, or None.

    An unknown option of a group (`data=digit`) is matched against the group's options; an unknown key
    (`trainer.max_epoch=1`) against the keys beside it in the config that `compose` builds without it (`extra`:
    more known keys at the top level, e.g. a tool's own options). In a section that `job` (train, eval, export)
    reads alone, the schema's message (config/schema.py), which does not offer `+key=VALUE`: it would be refused.
    A `+key=VALUE` of a key (or group) the config already holds: the form that sets it, `key=VALUE`.
    """
    from scaleup.config.schema import unknown_key_message

    if isinstance(err, OverrideParseException):
        return UserError(grammar_error(err))
    if (unseen := engine_groups_unseen()) is not None:
        return UserError(unseen)
    if (added := added_twice(err, overrides)) is not None:
        key, fixed = _override_key(added), added.removeprefix("+")
        return UserError(f"{added}: {key} is already in the config; set it with {fixed} (a leading + adds a new key)")
    if isinstance(err, MissingConfigException) and err.options is not None and err.missing_cfg_file:
        group, _, option = err.missing_cfg_file.rpartition("/")
        hint = did_you_mean(option, err.options, f"{group}=")
        return UserError(f"{group}={option}: there is no such option{hint} (the options: {', '.join(err.options)})")
    cause = err.__cause__
    if not isinstance(err, ConfigCompositionException) or not isinstance(cause, ConfigAttributeError | ConfigKeyError):
        return None
    key = str(cause.full_key or cause.key)
    parent, _, name = key.rpartition(".")
    try:
        config = compose([o for o in overrides if not f"{_override_key(o)}.".startswith(f"{key}.")])
    except Exception:  # another mistake among the overrides: no suggestion for this one
        config = None
    node = OmegaConf.select(config, parent) if config is not None and parent else config
    own = unknown_key_message(job, parent, name, node) if isinstance(node, DictConfig) else None
    if own is not None:
        return UserError(own)
    known = [*(node.keys() if isinstance(node, DictConfig) else ()), *([] if parent else extra)]
    hint = did_you_mean(name, known, f"{parent}." if parent else "")
    return UserError(f"{key}: there is no such key{hint} (a key of your own: +{key}=VALUE)")


def engine_groups_unseen() -> str | None:
    """Why the engine's config groups are not on Hydra's search path, or None when they are: Hydra did not find the
    engine's SearchPathPlugin (hydra_plugins/scaleup_searchpath), so every engine group fails to compose, the first
    with Hydra's `hydra=default: there is no such option`."""
    from hydra.core.plugins import Plugins
    from hydra.plugins.search_path_plugin import SearchPathPlugin

    from scaleup.conf import engine_groups

    found = Plugins.instance().discover(SearchPathPlugin)
    if any(plugin.__module__ == "hydra_plugins.scaleup_searchpath.searchpath" for plugin in found):
        return None
    unseen = (
        f"the engine's config groups ({', '.join(engine_groups())}) are not on Hydra's search path: Hydra did not "
        "find the engine's plugin hydra_plugins/scaleup_searchpath"
    )
    # hydra_plugins is a namespace package that every Hydra plugin adds to: one with an __init__.py hides the others
    spec = importlib.util.find_spec("hydra_plugins")
    if spec is not None and spec.origin is not None:
        return f"{unseen}: {spec.origin} hides it; delete that __init__.py (Hydra's plugins share the name)"
    return f"{unseen}; reinstall the engine: python -m pip install -c constraints.txt -e ./engine"


def added_twice(err: BaseException, overrides: list[str]) -> str | None:
    """The `+key=VALUE` among `overrides` that Hydra refused (`err`) because `key` is already in the config (a key,
    or a group with an option chosen: `+data=cifar10`), or None."""
    message = str(err) if isinstance(err, ConfigCompositionException) else ""
    for override in overrides:
        key = _override_key(override)
        there = f"An item is already at '{key}'" in message or message.startswith(f"Multiple values for {key}.")
        if there and override.startswith("+") and not override.startswith("++"):
            return override
    return None


def grammar_error(err: OverrideParseException) -> str:
    """An override Hydra cannot parse, with the parser's reason, in one line."""
    reason = next(
        (line for line in err.message.splitlines() if line and not line.startswith(("Error parsing", "See http"))),
        "",
    )
    return (
        f"{err.override}: not an override Hydra can read ({reason}); write key=value, and quote a value with "
        f"brackets, parentheses, commas or spaces: 'key=\"a value\"' ({GRAMMAR})"
    )


FULL_ERROR = "HYDRA_FULL_ERROR"  # "1": Hydra raises what fails instead of reporting it (its run_and_report)
_composing = False  # whether FULL_ERROR is one_line_composition_errors', until the job starts


def one_line_composition_errors(config_dir: Path, config_name: str) -> Callable[[Callable], Callable]:
    """Decorate an `@hydra.main` entry point whose task function calls `job_started` first: a mistake in the
    overrides that Hydra finds while it composes the config, before the job starts (so before `exit_on_user_error`),
    ends in one line and exit code 2 instead of Hydra's message.

    Only Hydra composes the config (a composition of the engine's before it cost 0.1 s a run): until the job starts,
    HYDRA_FULL_ERROR=1 makes Hydra raise what fails instead of reporting it, and a mistake is turned into its line
    here (composing again for the closest key: only then). From the job's start on, Hydra reports the job's own
    errors as usual, a bug with its traceback. With Hydra's own flags (`--multirun`, `--cfg` ...), or a
    HYDRA_FULL_ERROR of the user's, Hydra reports as usual."""

    def decorate(hydra_main: Callable) -> Callable:
        @functools.wraps(hydra_main)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            global _composing
            overrides = sys.argv[1:]
            if args or kwargs or any(arg.startswith("-") for arg in overrides) or FULL_ERROR in os.environ:
                return hydra_main(*args, **kwargs)
            os.environ[FULL_ERROR], _composing = "1", True
            try:
                return hydra_main()
            except Exception as err:
                if not _composing:  # the job's own, which Hydra raises under a debugger
                    raise
                job_started()
                exit_on_composition_error(err, config_dir, config_name, overrides)
                return hydra_main()  # no mistake of the overrides: Hydra composes again and reports what fails
            finally:
                job_started()

        return wrapper

    return decorate


def tracebacks_asked() -> bool:
    """Whether the user set HYDRA_FULL_ERROR=1 to see the traceback behind a user error too (not
    `one_line_composition_errors`, which sets it while Hydra composes)."""
    return os.environ.get(FULL_ERROR) == "1" and not _composing


def job_started() -> None:
    """The first call of the task function (or of the search's sweeper) under `one_line_composition_errors`: the
    config is composed, and Hydra reports errors as usual again (the engine's own checks of a HYDRA_FULL_ERROR the
    user set see none); the processes the job starts (a launcher's ranks) inherit no HYDRA_FULL_ERROR."""
    global _composing
    if _composing:
        del os.environ[FULL_ERROR]
        _composing = False


def exit_on_composition_error(err: Exception, config_dir: Path, config_name: str, overrides: list[str]) -> None:
    """On an unknown key or group option behind Hydra's composition error `err` (composing `config_name` with
    `overrides`), `error: <message>` and exit 2."""
    from scaleup.config.project import compose_project  # it imports this module

    def composed(given: list[str]) -> DictConfig:
        return compose_project(config_name, given, configs=config_dir)

    user_error = composition_error(err, composed, overrides, job=config_name)
    if user_error is not None:
        print(f"error: {user_error}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)


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
