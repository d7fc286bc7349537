"""Aligned `name  value` rows in the log: the plan, a run's results, a search's trials."""

from __future__ import annotations

import logging
from collections.abc import Sequence

log = logging.getLogger("scaleup")
SHOWN = 8  # names listed before "... (N in all)"


def log_rows(title: str, rows: list[tuple[str, str]]) -> None:
    """Log a title and aligned `name  value` rows under it (`(none)` for no rows)."""
    width = max((len(name) for name, _ in rows), default=0)
    lines = [f"  {name:<{width}}  {value}" for name, value in rows] or ["  (none)"]
    log.info("\n".join([title, *lines]))


def shown(names: Sequence[str], limit: int = SHOWN) -> str:
    """The first `limit` of `names`, comma-separated, and how many there are in all where there are more."""
    return ", ".join(names[:limit]) + (f" ... ({len(names)} in all)" if len(names) > limit else "")
