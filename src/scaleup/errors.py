"""User mistakes end in one clear message and a non-zero exit, never a traceback.

Two kinds of error count as the user's:
- a `UserError` that the code raises on purpose, naming the fix;
- an error that says the user's input is wrong wherever it is raised: a config value left `???` or a broken
  interpolation (omegaconf), a path that cannot be read or written (an OSError naming a file), and, while
  objects are built from a config section (`config_errors`), the ValueError or TypeError a constructor raises
  for a bad value or an unknown argument.
Anything else is a bug and keeps its traceback. `HYDRA_FULL_ERROR=1` shows the traceback behind a user error too.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from hydra.experimental.callback import Callback
from lightning.fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException


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


def _chain(err: BaseException | None, *, implicit: bool) -> Iterator[BaseException]:
    """`err` and the errors it was raised from (`__cause__`; with `implicit`, also `__context__`)."""
    while err is not None:
        yield err
        err = err.__cause__ or (err.__context__ if implicit else None)


def _first_line(err: BaseException) -> str:
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
        if isinstance(link, MissingMandatoryValue):
            key = link.full_key or link.key
            return UserError(f"{key} has no value (it is ??? in the config): pass {key}=<value>")
        if isinstance(link, OmegaConfBaseException):
            where = f" (at {link.full_key})" if link.full_key else ""
            return UserError(f"the config does not resolve{where}: {_first_line(link)}")
        if isinstance(link, OSError) and link.filename is not None:
            return UserError(
                f"{link.filename}: {link.strerror or _first_line(link)}; check that path in your overrides "
                "(a directory to write into must be creatable, a file to read must exist and be readable)"
            )
    return None


@contextlib.contextmanager
def config_errors(section: str) -> Iterator[None]:
    """Errors raised while building objects from the config section `section` are mistakes in that section.

    A ValueError or TypeError from a constructor or factory (a value out of range, an unknown argument), also
    when Hydra's instantiate wraps it, and Lightning's MisconfigurationException become `section: <message>`.
    """
    try:
        yield
    except Exception as err:
        if as_user_error(err) is not None:
            raise
        cause = err.__cause__ if isinstance(err, InstantiationException) and err.__cause__ is not None else err
        if isinstance(cause, ValueError | TypeError | MisconfigurationException):
            raise UserError(f"{section}: {_first_line(cause)}") from err
        raise


def exit_on_user_error(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a user mistake raised by a job into `error: <message>` on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            user_error = as_user_error(err)
            if user_error is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            print(f"error: {user_error}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)

    return wrapper


class RunDirCheck(Callback):
    """Hydra creates the run directory before the job starts, outside `exit_on_user_error`: a directory that
    cannot be created (`hydra.run.dir=/read-only/path`) would end in Hydra's traceback. Create it here first."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        directory = config.hydra.run.dir
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
