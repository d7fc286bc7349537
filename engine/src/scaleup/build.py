"""The run's data module and model, built from the config, each told what it needs from the other; a model alone
from a checkpoint's stored config (`build_model`)."""

from __future__ import annotations

import copy
import logging
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig
from torchmetrics import Metric

from scaleup.config.plain import is_float64, lookup
from scaleup.config.schema import TEMPLATE_BATCH_KEYS, accepted_arguments, argument_hints, fits
from scaleup.config.typed import TrainConfig, values
from scaleup.data.adopted import AdoptedDataModule
from scaleup.data.datamodule import GlobalBatchDataModule, apply_model_settings, sizes_for_plan
from scaleup.errors import UserError, config_errors

log = logging.getLogger("scaleup")


def build_model(model_cfg: dict[str, Any], precision: Any = "32-true") -> L.LightningModule:
    """The LightningModule from `model` config; nested `net`/`optimizer` stay dicts (it builds them itself).

    Built in float64 for `64-true`: Lightning loads a checkpoint's weights into the module before its precision
    plugin casts the module to float64, so a float32 module would round every resumed or evaluated weight. Its
    torchmetrics states too, which `.double()` leaves as they are: summed in float32, a metric would differ
    between device counts (another order of the same additions) in its 7th digit, where float64 weights agree.
    """
    kwargs = dict(model_cfg)
    target = kwargs.pop("_target_")
    model = get_class(target)(**{name: built(target, name, value) for name, value in kwargs.items()})
    if not is_float64(precision):
        return model
    for metric in model.modules():
        if isinstance(metric, Metric):
            metric.set_dtype(torch.float64)
    return model.double()


def built(target: str, argument: str, value: Any) -> Any:
    """`value` as the constructor `target` takes `argument`: a config with a `_target_` stays a dict where the hint
    takes a mapping (or there is none: the module builds it), and is instantiated where it asks for an object
    (`net: nn.Module`; an optimizer with `_partial_: true`), as Hydra's own recursive instantiation would."""
    if not (isinstance(value, dict) and "_target_" in value) or takes_a_mapping(target, argument):
        return value
    return instantiate(value, _convert_="all")


def takes_a_mapping(target: str, argument: str) -> bool:
    """Whether the hint of `argument` of the class `target` names takes a dict: none, `Any`, or a mapping type."""
    try:
        hint = typing.get_type_hints(get_class(target).__init__).get(argument, Any)
    except (NameError, TypeError):
        return True
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    for option in options:
        kind = typing.get_origin(option) or option
        if kind is Any or (isinstance(kind, type) and issubclass(kind, Mapping | DictConfig)):
            return True
    return False


def build_datamodule(data_cfg: dict[str, Any], loader: dict[str, Any], seed: int) -> GlobalBatchDataModule:
    """The `data` config's DataModule, with the shared `loader` settings and the run's seed; any other
    LightningDataModule is built from its own keys and adopted (data/adopted.py): the batch keys are the
    template's, given to its constructor only where it takes them."""
    target = data_cfg["_target_"]
    if issubclass(get_class(target), GlobalBatchDataModule):
        with config_errors("data"):
            return instantiate(data_cfg, **loader, seed=seed)
    accepted = accepted_arguments(target)
    batches = {key: data_cfg[key] for key in TEMPLATE_BATCH_KEYS if key in data_cfg}
    own = {key: value for key, value in data_cfg.items() if key not in batches or accepted is None or key in accepted}
    with config_errors("data"):
        module = instantiate(own, _convert_="all")  # lists and dicts as such, not OmegaConf's containers
    if not isinstance(module, L.LightningDataModule):
        raise UserError(f"data._target_={target} makes a {type(module).__name__}, not a LightningDataModule")
    return AdoptedDataModule(module, **batches, seed=seed)


def build_data_and_model(
    config: TrainConfig, run_dir: Path, strategy: Any = None
) -> tuple[GlobalBatchDataModule, L.LightningModule, dict[str, int]]:
    """The data module, the LightningModule, and the split sizes the plan is made from.

    The data is downloaded and set up first: the plan needs its split sizes, the model what only the data knows
    (classes, input channels, vocabulary), filled into the `model` config where it says null. A dry run takes only
    what the data module states without its files, and builds the net with 2 for what it cannot state (the plan
    needs the parameter groups and whether there is BatchNorm, not those sizes). A run's `strategy` (the launch's)
    builds the model where it has a `build_model(build)`: strategy=fsdp's, on the meta device with its construction
    recorded, for each rank's shards (distributed/fsdp.py).
    """
    datamodule = build_datamodule(config.data, values(config.loader), config.seed)
    dataset_sizes = sizes_for_plan(datamodule, run_dir=run_dir, dry_run=config.dry_run)
    if isinstance(datamodule, AdoptedDataModule):
        take_recipe_batch(config, datamodule)
    settings = datamodule.model_settings()
    apply_model_settings(config.model, settings)
    check_model_fits_data(config.model, config.data, settings)
    model_cfg = config.model
    if unknown := [key for key, value in settings.items() if value is None]:
        log.info(f"model.{', model.'.join(unknown)} unknown until the data is there: the dry run builds the net with 2")
        model_cfg = copy.deepcopy(model_cfg)
        apply_model_settings(model_cfg, dict.fromkeys(unknown, 2))

    def build() -> L.LightningModule:
        with config_errors("model"):
            return build_model(model_cfg, precision=config.trainer.precision)

    if config.dry_run:
        # Shapes and parameter groups, no memory and no time: a 7B model plans on a laptop.
        with torch.device("meta"):
            return datamodule, build(), dataset_sizes
    builds_it = getattr(strategy, "build_model", None)
    return datamodule, builds_it(build) if builds_it else build(), dataset_sizes


def take_recipe_batch(config: TrainConfig, datamodule: AdoptedDataModule) -> None:
    """An adopted DataModule's train loader batch size is the global batch where the config sets no batch key:
    what it trains on one device, kept on N (config.yaml and checkpoints record it). Otherwise the plan's
    per-device batch replaces it; either way one line says so."""
    own, name = datamodule.recipe_batch_size(), type(datamodule.module).__name__
    batches = config.batches
    if batches.global_batch_size is not None or batches.per_device_batch_size is not None:
        if own is not None:
            log.info(f"data: the plan's per-device batch replaces the batch_size={own} of {name}'s own loaders")
        return
    if own is None:
        raise UserError(
            f"data: {name}'s train loader has no batch_size (a batch sampler of its own): set data.global_batch_size"
        )
    log.info(f"data: {name}'s train loader batch_size={own} is the global batch, split over the devices")
    batches.global_batch_size = datamodule.global_batch_size = config.data["global_batch_size"] = own


def check_model_fits_data(model_cfg: dict[str, Any], data_cfg: dict[str, Any], settings: dict[str, Any]) -> None:
    """A model whose net still waits for a setting (`null`) while the data offers others it has no key for was
    made for another kind of data (an image classifier on text): say so instead of failing inside the net."""
    net = model_cfg.get("net")
    waiting = [key for key, value in net.items() if value is None] if isinstance(net, dict) else []
    unused = [key for key in settings if not has_key(model_cfg, key)]
    data, model = data_cfg["_target_"], model_cfg["_target_"]
    if waiting and unused:
        raise UserError(
            f"the model ({model}) does not fit the data ({data}): model.net.{', model.net.'.join(waiting)} "
            f"wait(s) for the data, which provides {', '.join(f'model.{key}' for key in settings)} instead. "
            "Choose a model made for this data (e.g. experiment=char_lm for text), or set those keys"
        )
    if missing := [key for key in waiting if f"net.{key}" not in settings and refuses_none(net.get("_target_"), key)]:
        given = f" (it gives {', '.join(f'model.{key}' for key in settings)})" if settings else ""
        keys, them = ", ".join(f"model.net.{key}" for key in missing), "them" if len(missing) > 1 else "it"
        raise UserError(
            f"{keys} {'are' if len(missing) > 1 else 'is'} null, to be taken from the data, and the data ({data}) "
            f"does not give {them}{given}: set {' '.join(f'model.net.{key}=<value>' for key in missing)}"
        )


def refuses_none(target: str | None, argument: str) -> bool:
    """Whether the type hint of `argument` of the class or function `target` names leaves out None (a net's
    `num_classes: int`); an argument without a hint, or of a net config without a `_target_`, may take None."""
    hinted = argument_hints(target).get(argument) if isinstance(target, str) else None
    return hinted is not None and not fits(hinted[1], None)


def has_key(tree: dict[str, Any], dotted: str) -> bool:
    parent, _, leaf = dotted.rpartition(".")
    node = lookup(tree, parent)
    return isinstance(node, dict) and leaf in node
