"""User mistakes end in one clear message and a non-zero exit, never a traceback."""

import functools
import sys
from collections.abc import Callable
from typing import Any


class UserError(Exception):
    """A mistake the user can fix; the message says how."""


EXIT_USER_ERROR = 2


def exit_on_user_error(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a `UserError` raised by a job into `error: <message>` on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except UserError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)

    return wrapper
