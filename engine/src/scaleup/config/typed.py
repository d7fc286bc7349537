"""Each job's config as one typed record, made once from the checked config and read everywhere after.

The engine's own sections are the schema's models (config/schema.py), read as attributes with types; the user's own
sections (data, model, callbacks, logger) stay the dicts their `_target_`s take. Nothing here has a default of its
own: every value is the composed config's (the YAML groups state the defaults), checked before the record is made,
or for a batch key the data section leaves out, what the data module's constructor makes of it.
"""

from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from scaleup.config.schema import (
    Checkpointing,
    DataBatches,
    EvalTrainer,
    Init,
    Loader,
    LRScheduleSettings,
    Monitor,
    Performance,
    Section,
    Strategy,
    TrainerArgs,
    missing_key_message,
    validate_config,
)
from scaleup.errors import UserError


def train_config(cfg: DictConfig) -> TrainConfig:
    """`python train.py`'s composed config, every value checked (one UserError naming each wrong one), as the
    typed record the job reads."""
    return TrainConfig.of(validate_config(cfg, "train", command_line()))


def eval_config(cfg: DictConfig) -> EvalConfig:
    """`python eval.py`'s config, checked, as the record the job reads."""
    return EvalConfig.of(validate_config(cfg, "eval", command_line()))


def export_config(cfg: DictConfig) -> ExportConfig:
    """`python export.py`'s config, checked, as the record the job reads."""
    return ExportConfig.of(validate_config(cfg, "export", command_line()))


def command_line() -> list[str]:
    """The command line's overrides that composed the running job's config (none outside a Hydra job)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return []
    return OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False)  # as typed: ${...} unresolved


def data_batches(data: dict[str, Any]) -> DataBatches:
    """The batch keys of the `data` section; one it leaves out is what every data module's constructor
    (GlobalBatchDataModule's) makes of it."""
    from scaleup.data.datamodule import GlobalBatchDataModule

    parameters = inspect.signature(GlobalBatchDataModule.__init__).parameters
    defaults = {name: parameters[name].default for name in DataBatches.model_fields}
    return section(DataBatches, defaults | data)


def record(cls: type[Any], config: dict[str, Any], job: str, **given: Any) -> Any:
    """The dataclass `cls` from `job`'s `config`: a field typed as a section is that section's record, one `given` is
    as given, every other one is as the config holds it."""
    fields = {}
    for name, hint in typing.get_type_hints(cls).items():
        if name not in given:
            value = needed(config, name, job)
            fields[name] = section(hint, value) if isinstance(hint, type) and issubclass(hint, Section) else value
    return cls(**fields, **given)


def needed(config: dict[str, Any], name: str, job: str) -> Any:
    """`config[name]`, which `job` reads: where the config does not hold it (`~data` removed it, leaving only the
    batch keys the top config states for any data module), a UserError naming the form that sets it."""
    if name not in config or (job == "train" and name == "data" and "_target_" not in (config[name] or {})):
        raise UserError(missing_key_message(job, name))
    return config[name]


def section(model: type[Section], values: dict[str, Any]) -> Any:
    """`values` as `model`'s record, without checking them again (validate_config did): a key of another option
    (an FSDP key in a DDP run) is no attribute, and a key the model does not declare is kept as an extra."""
    return model.model_construct(**values)


@dataclass(frozen=True)
class TrainConfig:
    """`python train.py`'s config. `plain` is all of it as composed, resolved: what config.yaml and checkpoints
    store; `data`, `model`, `callbacks` and `logger` are its sections of the user's own."""

    seed: int
    dry_run: bool
    ckpt_path: str | None
    diagnostics_from: str | None
    fresh_start: bool
    stop_on_nonfinite_loss: bool
    monitor: Monitor
    checkpoint: Checkpointing
    performance: Performance
    loader: Loader
    lr_schedule: LRScheduleSettings
    trainer: TrainerArgs
    init: Init
    strategy: Strategy
    batches: DataBatches  # the batch keys every data module takes, read by the plan
    data: dict[str, Any]
    model: dict[str, Any]
    callbacks: dict[str, Any]
    logger: dict[str, Any]
    plain: dict[str, Any]

    @classmethod
    def of(cls, config: dict[str, Any]) -> TrainConfig:
        """The record of a checked, resolved train config (`to_plain` of the composed one)."""
        return record(
            cls,
            config,
            "train",
            batches=data_batches(needed(config, "data", "train")),
            callbacks=config.get("callbacks") or {},  # callbacks=[] and logger=[] leave no key
            logger=config.get("logger") or {},
            plain=config,
            # Keys a project's configs/train.yaml from an earlier engine does not hold: their defaults.
            fresh_start=config.get("fresh_start", False),
            stop_on_nonfinite_loss=config.get("stop_on_nonfinite_loss", True),
        )


@dataclass(frozen=True)
class EvalConfig:
    """`python eval.py`'s config: the checkpoint, the per-device batch (None: training's), whether to
    compile, the `data` keys that override the checkpoint's stored ones, and the Trainer's settings."""

    ckpt_path: str
    batch_size: int | None
    compile: bool
    data: dict[str, Any]
    trainer: EvalTrainer

    @classmethod
    def of(cls, config: dict[str, Any]) -> EvalConfig:
        return record(cls, config, "eval")


@dataclass(frozen=True)
class ExportConfig:
    """`python export.py`'s config: the checkpoint, the file to write (and whether to overwrite it),
    and the attribute path of the module to save."""

    ckpt_path: str
    output_path: str
    overwrite: bool
    module: str

    @classmethod
    def of(cls, config: dict[str, Any]) -> ExportConfig:
        return record(cls, config, "export")


def values(settings: Section) -> dict[str, Any]:
    """A section's keys and values as the config gave them (with the extras a section passes on, such as every
    lightning.Trainer argument): what a constructor takes as keyword arguments."""
    return {**{name: getattr(settings, name) for name in settings.model_fields_set}, **(settings.model_extra or {})}


def target(settings: Section) -> str:
    """The `_target_` an engine section's option names for its part (init's: scaleup.finetune.prepare_start)."""
    return (settings.model_extra or {})["_target_"]
