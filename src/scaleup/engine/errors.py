"""User mistakes end in one clear message and a non-zero exit, never a traceback."""

import functools
import sys
from collections.abc import Callable
from typing import Any


class UserError(Exception):
    """A mistake the user can fix; the message says how."""


EXIT_USER_ERROR = 2


def user_error_in(err: BaseException | None) -> UserError | None:
    """The UserError behind `err`, also when a library re-raised it (Hydra's instantiate wraps errors)."""
    while err is not None:
        if isinstance(err, UserError):
            return err
        err = err.__cause__ or err.__context__
    return None


def exit_on_user_error(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a `UserError` raised by a job into `error: <message>` on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            cause = user_error_in(err)
            if cause is None:
                raise
            print(f"error: {cause}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)

    return wrapper
