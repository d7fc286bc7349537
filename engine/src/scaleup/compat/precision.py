"""The precisions Lightning accepts, and float64 under ModelParallelStrategy."""

from __future__ import annotations

from typing import Any

# Every `Trainer(precision=...)` spelling Lightning 2.6 accepts (its documentation's list; pyproject.toml caps
# Lightning below 2.7): what the config schema checks `trainer.precision` against.
PRECISIONS = (
    64, 32, 16, "transformer-engine", "transformer-engine-float16", "16-true", "16-mixed", "bf16-true", "bf16-mixed",
    "32-true", "64-true", "64", "32", "16", "bf16",
)  # fmt: skip


def model_parallel_precision(precision: str) -> tuple[str | None, list[Any]]:
    """(Trainer's `precision`, precision plugins) for ModelParallelStrategy: float64 as a plugin.

    Lightning 2.6.6. Reason: the accelerator connector refuses `precision="64-true"` with ModelParallelStrategy (it
    allows 32-true, bf16-mixed, bf16-true, 16-true), though FSDP2 trains float64 DTensors on CPU; the same
    DoublePrecision plugin passed in `plugins` is accepted (the check reads only the precision flag).
    Canary: test_model_parallel_strategy_refuses_64_true_as_a_flag.
    """
    from lightning.pytorch.plugins.precision import DoublePrecision

    return (None, [DoublePrecision()]) if precision == "64-true" else (precision, [])
