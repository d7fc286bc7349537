"""The plan made from everything it depends on: the config, the topology, the launch, the model and the data's
sizes; then the start-up checks that need the whole plan."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import lightning as L

from scaleup.distributed.launch import Launch
from scaleup.errors import config_errors
from scaleup.plan.checks import check_config, has_batchnorm
from scaleup.plan.lr import base_lrs
from scaleup.plan.progress import check_manual_optimization
from scaleup.plan.resolve import Plan, PlanRecord, build_plan, early_stopping_entry
from scaleup.plan.topology import Topology

if TYPE_CHECKING:
    from scaleup.config.typed import TrainConfig


def make_plan(
    config: TrainConfig,
    topology: Topology,
    launch: Launch,
    model: L.LightningModule,
    dataset_sizes: dict[str, int],
    on_meta: bool = False,
    probe: L.Trainer | None = None,
) -> Plan:
    """The plan `train.py` prints, saves and trains by, checked against the config. `on_meta`: the model is built on
    the meta device (strategy.meta_init, where its build can be replayed). `probe`: a dry run's Trainer, which
    `configure_optimizers` is called on once for the param groups' LRs; a run reads them from the optimizers
    Lightning builds when fit starts, its one call (Plan.base_lrs)."""
    lrs = None
    if probe is not None:
        with config_errors("model.optimizer"):  # e.g. a negative learning rate, refused by the optimizer
            lrs = base_lrs(model, probe)
    plan = build_plan(
        topology=topology,
        trainer=config.trainer,
        batches=config.batches,
        lr_schedule=config.lr_schedule,
        base_lrs=lrs,
        seed=config.seed,
        dataset_sizes=dataset_sizes,
        has_batchnorm=has_batchnorm(model),
        strategy=launch.name,
        early_stopping=early_stopping_entry(config.callbacks),
        performance=config.performance,
        launcher=launch.launcher,
    )
    plan = replace(
        plan,
        parameters=sum(p.numel() for p in model.parameters()),
        trainable_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
        manual_optimization=not model.automatic_optimization,
        records=strategy_records(launch.strategy, model, on_meta),
    )
    if plan.manual_optimization:
        check_manual_optimization(type(model).__name__, plan, config.trainer.accumulate_grad_batches)
    check_config(config, plan)
    return plan


def strategy_records(strategy: Any, model: L.LightningModule, on_meta: bool) -> tuple[PlanRecord, ...]:
    """The record the launch's strategy adds to the plan, through a method `plan_record(model, on_meta=...)` (FSDP's
    sharding: distributed/fsdp.py); a strategy without one adds none."""
    plan_record = getattr(strategy, "plan_record", None)
    return () if plan_record is None else (plan_record(model, on_meta=on_meta),)
