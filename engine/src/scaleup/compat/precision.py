"""The precisions Lightning accepts, and float64 under ModelParallelStrategy."""

from __future__ import annotations

import typing
from typing import Any

# Lightning 2.6's `_PRECISION_INPUT`, spelled out.
PRECISIONS_2_6 = (
    "transformer-engine", "transformer-engine-float16", "16-true", "16-mixed", "bf16-true", "bf16-mixed", "32-true",
    "64-true", 64, 32, 16, "64", "32", "16", "bf16",
)  # fmt: skip


def lightning_precisions() -> tuple[str | int, ...]:
    """Every `Trainer(precision=...)` spelling Lightning accepts (64-true, bf16-mixed, 16, ...).

    Lightning 2.6.6. Reason: the list lives only in the private type `lightning.fabric.connector._PRECISION_INPUT`
    (a Union of Literals); the config schema checks `trainer.precision` against it.
    Canary: test_private_precision_spellings_include_the_templates. Where that type is gone, Lightning 2.6's list.
    """
    try:
        from lightning.fabric.connector import _PRECISION_INPUT
    except ImportError:
        return PRECISIONS_2_6

    def literals(hint: Any) -> tuple[Any, ...]:
        return tuple(v for arg in typing.get_args(hint) for v in (literals(arg) if typing.get_args(arg) else (arg,)))

    return literals(_PRECISION_INPUT)


def model_parallel_precision(precision: str) -> tuple[str | None, list[Any]]:
    """(Trainer's `precision`, precision plugins) for ModelParallelStrategy: float64 as a plugin.

    Lightning 2.6.6. Reason: the accelerator connector refuses `precision="64-true"` with ModelParallelStrategy (it
    allows 32-true, bf16-mixed, bf16-true, 16-true), though FSDP2 trains float64 DTensors on CPU; the same
    DoublePrecision plugin passed in `plugins` is accepted (the check reads only the precision flag).
    Canary: test_model_parallel_strategy_refuses_64_true_as_a_flag.
    """
    from lightning.pytorch.plugins.precision import DoublePrecision

    return (None, [DoublePrecision()]) if precision == "64-true" else (precision, [])
