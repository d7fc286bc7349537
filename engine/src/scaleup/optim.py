"""The optimizer from config, with weight decay only where it helps."""

from collections.abc import Mapping
from typing import Any

import torch
from hydra.utils import instantiate
from torch import nn

from scaleup.modules import selected


def build_optimizer(
    optimizer_cfg: Mapping[str, Any], module: nn.Module, lr_scales: Mapping[str, float] | None = None
) -> torch.optim.Optimizer:
    """`optimizer_cfg` (a Hydra `_target_` dict) over two param groups: "decay" (weights) and "no_decay" (norm
    weights and biases, the 1-d tensors: decaying them only hurts, Goyal et al. 2017). Frozen parameters
    (requires_grad=False, e.g. init.freeze) are left out.

    The config's LR is the unscaled base LR; LRScaling (in the StepPlan callback) multiplies each group's LR by the
    schedule's factor every step, so a group given its own "lr" here keeps its ratio to the others. `lr_scales`
    gives some parameters their own: a parameter or module name (`net.13`) or a regular expression -> a factor on the
    base LR (a new head at 10x a pretrained backbone's); each is a pair of groups of its own, "decay@<name>" and
    "no_decay@<name>", and a parameter takes the first that names it.
    """
    scales = dict(lr_scales or {})
    params = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    owner = {name: next((key for key in scales if selected([key], name)), None) for name, _ in params}
    groups = []
    for key in [None, *scales]:
        members = [p for name, p in params if owner[name] == key]
        for kind, chosen in (
            ("decay", [p for p in members if p.ndim > 1]),
            ("no_decay", [p for p in members if p.ndim <= 1]),
        ):
            if key is not None and not chosen:
                continue
            group: dict[str, Any] = {"params": chosen, "name": kind if key is None else f"{kind}@{key}"}
            if kind == "no_decay":
                group["weight_decay"] = 0.0
            if key is not None:
                group["lr"] = float(optimizer_cfg["lr"]) * scales[key]
            groups.append(group)
    return instantiate(dict(optimizer_cfg), _partial_=True)(groups)
