"""Reading shards from a local directory or any fsspec URL (s3://, gs://, https://, memory://), with bounded
retries: a dead remote is one clear error after a few seconds, not a hang or a traceback from deep in a client."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from scaleup.errors import UserError

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Tries per read, waiting 0.5 s, 1 s, 2 s ... between them: about 8 s before a dead remote is reported.
RETRIES = 5
BACKOFF_S = 0.5


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of `url` and the path on it (a plain path is the local filesystem)."""
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as err:  # e.g. s3:// without s3fs installed
        raise UserError(f"cannot read {url}: {err}") from None
    return fs, path.rstrip("/")


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


class MissingFile(UserError):
    """A file the URL does not hold (no retry: another try gives the same answer)."""


def with_retries(read: Callable[[], T], url: str) -> T:
    """`read()`, tried up to `RETRIES` times with exponential backoff on connection errors and timeouts.

    A missing file or a refused permission is final at once (another try gives the same answer).
    """
    retries = RETRIES
    for attempt in range(1, retries + 1):
        try:
            return read()
        except FileNotFoundError:
            raise MissingFile(f"{url} does not exist: check data.url (the directory holding index.json)") from None
        except PermissionError as err:
            raise UserError(f"{url}: permission denied ({err}); check the credentials for this URL") from None
        except (OSError, TimeoutError, ConnectionError) as err:
            if attempt == retries:
                raise UserError(
                    f"{url} could not be read after {retries} tries ({type(err).__name__}: {err}): the remote "
                    "seems down or unreachable; check the URL and the network, then resume with ckpt_path=last"
                ) from None
            wait = BACKOFF_S * 2 ** (attempt - 1)
            log.warning(
                f"reading {url} failed ({type(err).__name__}: {err}); try {attempt + 1} of {retries} in {wait} s"
            )
            time.sleep(wait)
    raise AssertionError("unreachable")
