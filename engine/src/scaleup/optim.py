"""The optimizer from config, with weight decay only where it helps."""

from collections.abc import Mapping
from typing import Any

import torch
from hydra.utils import instantiate
from torch import nn


def build_optimizer(optimizer_cfg: Mapping[str, Any], module: nn.Module) -> torch.optim.Optimizer:
    """`optimizer_cfg` (a Hydra `_target_` dict) over two param groups: "decay" (weights) and "no_decay" (norm
    weights and biases, the 1-d tensors: decaying them only hurts, Goyal et al. 2017).

    The config's LR is the unscaled base LR; the LRScaling callback multiplies each group's LR by the schedule's
    factor every step, so a group given its own "lr" here keeps its ratio to the others.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim > 1], "name": "decay"},
        {"params": [p for p in params if p.ndim <= 1], "name": "no_decay", "weight_decay": 0.0},
    ]
    return instantiate(dict(optimizer_cfg), _partial_=True)(groups)
