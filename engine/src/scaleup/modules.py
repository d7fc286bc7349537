"""Reaching into the user's LightningModule by name, for the keys that name a part of it (export's `module`,
`init.module`)."""

from __future__ import annotations

from torch import nn

from scaleup.errors import UserError


def submodule(model: nn.Module, path: str, key: str = "module") -> nn.Module:
    """`model.<path>` for a dotted attribute path ('' for the model itself), or a UserError naming the module's
    children and the config key (`key`) that picks one."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        children = ", ".join(name for name, _ in model.named_children())
        raise UserError(
            f"{type(model).__name__} has no submodule {path!r}; its children are {children}: pass {key}=<one of them>"
        ) from None
