"""Reading shards from a local directory or any fsspec URL (s3://, gs://, https://, memory://), with bounded
retries: a dead remote is one clear error after a few seconds, not a hang or a traceback from deep in a client."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable
from typing import TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from scaleup.errors import UserError

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Tries per read, waiting 0.5 s, 1 s, 2 s ... between them: about 8 s of waiting before a dead remote is reported.
#: The environment variables SCALEUP_READ_TRIES and SCALEUP_READ_BACKOFF_S change them (a flaky network, tests).
#: No try starts after GIVE_UP_S: a client that retries on its own inside each try (botocore) stays bounded too.
RETRIES = 5
BACKOFF_S = 0.5
GIVE_UP_S = 60.0


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of `url` and the path on it (a plain path is the local filesystem). A client that
    connects when it is made (ftp://, sftp://) is retried as a read is (`with_retries`)."""
    try:
        fs, path = with_retries(lambda: fsspec.core.url_to_fs(url), url)
    except (ImportError, ValueError) as err:  # e.g. s3:// without s3fs installed, an unknown protocol
        raise UserError(f"cannot read {url}: {err}") from None
    return fs, path.rstrip("/")


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


class MissingFile(UserError):
    """A file the URL does not hold (no retry: another try gives the same answer)."""


def _setting(name: str, default: float, cast: Callable[[str], float]) -> float:
    """The environment variable `name` read with `cast`, or `default` when it is not set."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return cast(value)
    except ValueError:
        raise UserError(f"{name}={value!r} is not a number") from None


@functools.cache
def transient_errors() -> tuple[type[BaseException], ...]:
    """What a later try may not meet again: connection errors and timeouts, and a remote's 5xx answers (s3fs and
    gcsfs raise those as OSError). With botocore installed (s3fs), also its connection errors (refused, closed,
    timed out), which are not OSErrors."""
    errors: tuple[type[BaseException], ...] = (OSError, TimeoutError, ConnectionError)
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError
    except ImportError:
        return errors
    return (*errors, BotoConnectionError, HTTPClientError)


@functools.cache
def credential_errors() -> tuple[type[BaseException], ...]:
    """What a client raises when it finds no credentials at all (botocore for s3fs, google.auth for gcsfs)."""
    errors: list[type[BaseException]] = []
    with contextlib.suppress(ImportError):
        from botocore.exceptions import NoCredentialsError

        errors.append(NoCredentialsError)
    with contextlib.suppress(ImportError):
        from google.auth.exceptions import DefaultCredentialsError

        errors.append(DefaultCredentialsError)
    return tuple(errors)


def with_retries(read: Callable[[], T], url: str) -> T:
    """`read()`, tried up to `RETRIES` times with exponential backoff on transient errors (`transient_errors`),
    for at most about `GIVE_UP_S`; then one UserError naming `url`.

    A missing file, a refused permission or missing credentials are final at once (another try gives the same
    answer).
    """
    retries = max(1, int(_setting("SCALEUP_READ_TRIES", RETRIES, int)))
    backoff = _setting("SCALEUP_READ_BACKOFF_S", BACKOFF_S, float)
    give_up = time.monotonic() + GIVE_UP_S
    for attempt in range(1, retries + 1):
        try:
            return read()
        except FileNotFoundError:
            raise MissingFile(f"{url} does not exist: check data.url (the directory holding index.json)") from None
        except PermissionError as err:
            raise UserError(f"{url}: permission denied ({err}); check the credentials for this URL") from None
        except credential_errors() as err:
            raise UserError(
                f"{url}: no credentials found ({err}); give them as the storage's client expects (s3://: "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE; gs://: GOOGLE_APPLICATION_CREDENTIALS)"
            ) from None
        except transient_errors() as err:
            wait = backoff * 2 ** (attempt - 1)
            if attempt == retries or time.monotonic() + wait > give_up:
                raise UserError(
                    f"{url} could not be read after {attempt} tries ({type(err).__name__}: {err}): the remote "
                    "seems down or unreachable; check the URL and the network, then resume with ckpt_path=last"
                ) from None
            log.warning(
                f"reading {url} failed ({type(err).__name__}: {err}); try {attempt + 1} of {retries} in {wait} s"
            )
            time.sleep(wait)
    raise AssertionError("unreachable")
