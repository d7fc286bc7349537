"""A sweep (`python train.py -m seed=1,2,3`) checks every job's config, and plans every training job, before the first
job starts."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

from hydra import compose
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from scaleup.config.composition import composition_error
from scaleup.config.schema import SECTIONS, validate_config
from scaleup.errors import EXIT_USER_ERROR, UserError, as_user_error, tracebacks_asked


def sweep_jobs(config: DictConfig) -> tuple[list[list[str]], set[str]]:
    """The overrides of each job of Hydra's basic sweeper, in its order, and the keys the sweep varies."""
    params = [f"{key}={value}" for key, value in (config.hydra.sweeper.get("params") or {}).items()]
    parsed = OverridesParser.create().parse_overrides([*params, *config.hydra.overrides.task])
    swept = {override.get_key_element() for override in parsed if override.is_sweep_override()}
    # As the basic sweeper orders them: one list of `key=value` per key (a later override of a key replaces the
    # earlier one in its place), and their product.
    choices: dict[str, list[str]] = {}
    for override in parsed:
        key = override.get_key_element()
        if override.is_sweep_override() and not override.is_discrete_sweep():
            raise HydraException(f"BasicSweeper does not support sweep type : {override.value_type.name}")
        values = (
            override.sweep_string_iterator() if override.is_sweep_override() else [override.get_value_element_as_str()]
        )
        choices[key] = [f"{key}={value}" for value in values]
    return [list(job) for job in itertools.product(*choices.values())], swept


def job_config(config_name: str, overrides: list[str], num: int) -> DictConfig:
    """Job `num`'s config, composed as the sweeper composes it, with Hydra's runtime set as the job would have it
    (its mode, and its output directory, which the config's paths interpolate)."""
    cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.mode = RunMode.MULTIRUN
        cfg.hydra.job.num = num
        cfg.hydra.runtime.output_dir = os.path.abspath(os.path.join(cfg.hydra.sweep.dir, cfg.hydra.sweep.subdir))
    return cfg


class SweepCheck(Callback):
    """Hydra's basic sweeper starts each job only when the one before it has finished: a mistake in the last job's
    values would be found after the others trained. Compose and validate every job's config (config/schema.py), and
    make each training job's plan as its dry run would, before any starts: a mistake is one line naming the job,
    exit code 2, nothing written. Other sweepers (Optuna) choose their values as they go; their jobs are checked when
    they start."""

    def on_multirun_start(self, config: DictConfig, config_name: str | None = None, **kwargs: Any) -> None:
        if config_name not in SECTIONS or not str(config.hydra.sweeper._target_).endswith(".BasicSweeper"):
            return
        jobs, swept = sweep_jobs(config)
        if (found := first_mistake(config_name, jobs)) is not None:
            num, user_error = found
            values = " ".join(o for o in jobs[num] if o.partition("=")[0].lstrip("+~") in swept)
            print(f"error: sweep job {num} ({values}): {user_error}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)


def first_mistake(config_name: str, jobs: list[list[str]]) -> tuple[int, UserError] | None:
    """The first job (its index) whose overrides hold a user mistake, and the mistake; None when all are right."""
    before = HydraConfig.instance().cfg
    try:
        for num, overrides in enumerate(jobs):
            if (user_error := job_mistake(config_name, overrides, num)) is not None:
                return num, user_error
    finally:
        HydraConfig.instance().cfg = before
    return None


def job_mistake(config_name: str, overrides: list[str], num: int) -> UserError | None:
    """The user mistake in job `num`'s config (an unknown key or option, a wrong value) or, for a training job, in its
    plan (a model made for other data, a batch that does not divide), or None."""

    def composed(given: list[str]) -> DictConfig:
        return compose(config_name, overrides=given)

    try:
        cfg = job_config(config_name, overrides, num)
        HydraConfig.instance().set_config(cfg)  # for the ${hydra:...} interpolations the values resolve
        validate_config(OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"]), config_name, overrides)
        if config_name == "train":
            dry_run(cfg)
    except Exception as err:
        user_error = composition_error(err, composed, overrides, job=config_name) or as_user_error(err)
        if user_error is None or tracebacks_asked():
            raise
        return user_error
    return None


def dry_run(cfg: DictConfig) -> None:
    """Plan the training job `cfg` (composed with its `hydra` node) as `dry_run=true` plans it: the data's sizes as
    its module states them, the model on the meta device, nothing downloaded, trained or started. In a scratch run
    directory, and silently: the job prints its plan when it runs."""
    from scaleup.train import train

    with tempfile.TemporaryDirectory() as scratch, silently():
        with read_write(cfg.hydra):  # read-only once HydraConfig holds it
            cfg.dry_run = True
            cfg.hydra.runtime.output_dir = scratch
        HydraConfig.instance().set_config(cfg)
        train(OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"]))


@contextlib.contextmanager
def silently() -> Iterator[None]:
    """No log record and no warning while inside."""
    disabled = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(disabled)
