"""The `key=value` arguments of the template's own commands (the converter, the Ray driver)."""

from __future__ import annotations

from typing import Any


def split_arguments(argv: list[str], defaults: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A command's own `key=value` options (those named in `defaults`, which fill the rest) apart from the
    Hydra overrides it passes on."""
    options, overrides = dict(defaults), []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key in options:
            options[key] = value
        else:
            overrides.append(arg)
    return options, overrides
