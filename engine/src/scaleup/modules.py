"""Reaching into the user's LightningModule by name, for the keys that name a part of it (export's `module`,
`init.module`) or some of its parameters (`init.freeze`, `init.skip`, `model.lr_scales`)."""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn

from scaleup.errors import UserError
from scaleup.observability.rows import shown


def submodule(model: nn.Module, path: str, key: str = "module") -> nn.Module:
    """`model.<path>` for a dotted attribute path ('' for the model itself), or a UserError naming the children of the
    deepest module on the path that is there, and the config key (`key`) that picks one."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        owner, found = model, []
        for part in path.split("."):
            children = dict(owner.named_children())
            if part not in children:
                break
            owner = children[part]
            found.append(part)
        where = ".".join([type(model).__name__, *found])
        names = list(dict(owner.named_children()))
        if not names:
            raise UserError(f"{where} has no submodules: pass {key}={'.'.join(found)} or a module above it") from None
        above = "".join(f"{name}." for name in found)
        raise UserError(
            f"{where} has no submodule {part!r}; its children are {shown(names)}: pass {key}={above}<one of them>"
        ) from None


def selected(patterns: Iterable[str | int], name: str) -> bool:
    """Whether one of `patterns` names `name`: the name itself, a module holding it (`fc` for `fc.weight`, `13` for
    `13.bias`: YAML reads that one as a number), or a regular expression matching all of it."""
    return any(name == str(p) or name.startswith(f"{p}.") or full_match(str(p), name) for p in patterns)


def full_match(pattern: str, name: str) -> bool:
    try:
        return re.fullmatch(pattern, name) is not None
    except re.error:  # a plain name with a character that regular expressions read otherwise
        return False


def unmatched(patterns: Iterable[str | int], names: list[str]) -> list[str | int]:
    return [p for p in patterns if not any(selected([p], name) for name in names)]
