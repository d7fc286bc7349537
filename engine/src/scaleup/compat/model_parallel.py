"""ModelParallelStrategy (FSDP2) as the template uses it: modules it shards itself, and one-file checkpoints whose
optimizer state Lightning would key by the wrong parameter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from torch.optim import Optimizer


@contextlib.contextmanager
def configure_model_counts_as_overridden(module: L.LightningModule) -> Iterator[None]:
    """Lets ModelParallelStrategy.setup accept a module that the template sharded, not its `configure_model`.

    Lightning 2.6.6. Reason: `ModelParallelStrategy.setup` raises TypeError unless the LightningModule overrides
    `configure_model` (where Lightning expects users to apply the parallelism); the template applies fully_shard
    itself, so users keep ordinary modules. While Lightning checks, the module carries an instance attribute (a
    no-op with its own code object), removed afterwards.
    Canary: test_model_parallel_strategy_refuses_a_module_without_configure_model.
    """
    overridden = "configure_model" in vars(module)
    if not overridden:
        module.configure_model = lambda: None  # a different __code__ than LightningModule.configure_model
    try:
        yield
    finally:
        if not overridden:
            del module.configure_model


@contextlib.contextmanager
def optimizer_states_keyed_in_group_order(module: torch.nn.Module, optimizers: list[Optimizer]) -> Iterator[None]:
    """While ModelParallelStrategy loads a one-file checkpoint, number its optimizer states as torch does.

    Lightning 2.6.6. Reason: a one-process checkpoint keys the optimizer state by index, over the param groups in
    order; Lightning's `_rekey_optimizer_state_if_needed` maps index i to the module's i-th parameter instead, so
    with two param groups (weights, then biases and norms) every state lands on another parameter (a shape error).
    Here each optimizer's own param groups give the names.
    Canary: test_model_parallel_rekeys_optimizer_state_by_module_order.
    """
    import lightning.fabric.strategies.model_parallel as fabric_model_parallel

    names = {id(param): name for name, param in module.named_parameters()}
    remaining = iter(optimizers)

    def rekey(state: dict[str, Any], _module: Any) -> dict[str, Any]:
        order = [names[id(param)] for group in next(remaining).param_groups for param in group["params"]]
        if not state["state"] or isinstance(next(iter(state["state"])), str):
            return state
        groups = [{**group, "params": [order[i] for i in group["params"]]} for group in state["param_groups"]]
        return {"state": {order[i]: value for i, value in state["state"].items()}, "param_groups": groups}

    original = fabric_model_parallel._rekey_optimizer_state_if_needed
    fabric_model_parallel._rekey_optimizer_state_if_needed = rekey
    try:
        yield
    finally:
        fabric_model_parallel._rekey_optimizer_state_if_needed = original
