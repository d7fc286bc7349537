"""How a job's config is composed on the command line, and the mistakes Hydra finds in the overrides while it does.

`run_app` runs a job as `@hydra.main` does; an unknown key or group option, or an override Hydra cannot read, is
one `error:` line and exit code 2 (`composition_error`), with the closest match composed again only then. Errors of
the job itself go to Hydra's own report: `scaleup.errors` decides which of them are the user's mistakes.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import hydra
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from scaleup.config.project import compose_project
from scaleup.config.schema import unknown_key_message
from scaleup.errors import UserError, already_in_config, did_you_mean, exit_with, override_key, tracebacks_asked

GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic"  # how Hydra reads a command line's overrides


def composition_error(
    err: BaseException,
    compose: Callable[[list[str]], DictConfig],
    overrides: list[str],
    extra: Iterable[str] = (),
    job: str | None = None,
) -> UserError | None:
    """The user mistake behind Hydra's composition error `err`, in one line with the closest match, or None.

    An unknown option of a group (`data=digit`) is matched against the group's options; an unknown key
    (`trainer.max_epoch=1`) against the keys beside it in the config that `compose` builds without it (`extra`:
    more known keys at the top level, e.g. a tool's own options). In a section that `job` (train, eval, export)
    reads alone, the schema's message (config/schema.py), which does not offer `+key=VALUE`: it would be refused.
    A `+key=VALUE` of a key (or group) the config already holds: the form that sets it, `key=VALUE`.
    """
    if isinstance(err, OverrideParseException):
        return UserError(grammar_error(err))
    if (unseen := engine_groups_unseen()) is not None:
        return UserError(unseen)
    if (added := added_twice(err, overrides)) is not None:
        return UserError(already_in_config(added))
    if isinstance(err, MissingConfigException) and err.options is not None and err.missing_cfg_file:
        group, _, option = err.missing_cfg_file.rpartition("/")
        hint = did_you_mean(option, err.options, f"{group}=")
        return UserError(f"{group}={option}: there is no such option{hint} (the options: {', '.join(err.options)})")
    cause = err.__cause__
    if not isinstance(err, ConfigCompositionException) or not isinstance(cause, ConfigAttributeError | ConfigKeyError):
        return None
    key = str(cause.full_key or cause.key)
    parent, _, name = key.rpartition(".")
    try:
        config = compose([o for o in overrides if not f"{override_key(o)}.".startswith(f"{key}.")])
    except Exception:  # another mistake among the overrides: no suggestion for this one
        config = None
    node = OmegaConf.select(config, parent) if config is not None and parent else config
    own = unknown_key_message(job, parent, name, node) if isinstance(node, DictConfig) else None
    if own is not None:
        return UserError(own)
    known = [*(node.keys() if isinstance(node, DictConfig) else ()), *([] if parent else extra)]
    hint = did_you_mean(name, known, f"{parent}." if parent else "")
    return UserError(f"{key}: there is no such key{hint} (a key of your own: +{key}=VALUE)")


def engine_groups_unseen() -> str | None:
    """Why the engine's config groups are not on Hydra's search path, or None when they are: Hydra did not find the
    engine's SearchPathPlugin (hydra_plugins/scaleup_searchpath), so every engine group fails to compose, the first
    with Hydra's `hydra=default: there is no such option`."""
    from hydra.core.plugins import Plugins
    from hydra.plugins.search_path_plugin import SearchPathPlugin

    from scaleup.conf import engine_groups

    found = Plugins.instance().discover(SearchPathPlugin)
    if any(plugin.__module__ == "hydra_plugins.scaleup_searchpath.searchpath" for plugin in found):
        return None
    unseen = (
        f"the engine's config groups ({', '.join(engine_groups())}) are not on Hydra's search path: Hydra did not "
        "find the engine's plugin hydra_plugins/scaleup_searchpath"
    )
    # hydra_plugins is a namespace package that every Hydra plugin adds to: one with an __init__.py hides the others
    spec = importlib.util.find_spec("hydra_plugins")
    if spec is not None and spec.origin is not None:
        return f"{unseen}: {spec.origin} hides it; delete that __init__.py (Hydra's plugins share the name)"
    return f"{unseen}; reinstall the engine: python -m pip install -c constraints.txt -e ./engine"


def added_twice(err: BaseException, overrides: list[str]) -> str | None:
    """The `+key=VALUE` among `overrides` that Hydra refused (`err`) because `key` is already in the config (a key,
    or a group with an option chosen: `+data=cifar10`), or None."""
    message = str(err) if isinstance(err, ConfigCompositionException) else ""
    for override in overrides:
        key = override_key(override)
        there = f"An item is already at '{key}'" in message or message.startswith(f"Multiple values for {key}.")
        if there and override.startswith("+") and not override.startswith("++"):
            return override
    return None


def grammar_error(err: OverrideParseException) -> str:
    """An override Hydra cannot parse, with the parser's reason, in one line."""
    reason = next(
        (line for line in err.message.splitlines() if line and not line.startswith(("Error parsing", "See http"))),
        "",
    )
    return (
        f"{err.override}: not an override Hydra can read ({reason}); write key=value, and quote a value with "
        f"brackets, parentheses, commas or spaces: 'key=\"a value\"' ({GRAMMAR})"
    )


MULTIRUN_FLAGS = ("-m", "--multirun")


VERSION_BASE = "1.3"  # the Hydra defaults the engine's configs are written for


MODES = ("hydra.mode=RUN", "hydra.mode=MULTIRUN")  # what run_app adds to the overrides, as Hydra's _run_app


def run_app(task_function: Callable[[DictConfig], Any], config_dir: Path, config_name: str) -> None:
    """Run `task_function` as `@hydra.main(config_path=config_dir, config_name=config_name)` runs it on the command
    line's overrides (`-m` included), with one difference: a mistake in the overrides that Hydra finds while it
    composes the config (an unknown key, a group option that does not exist, an override it cannot parse) ends in
    one `error:` line and exit code 2 instead of Hydra's message.

    Hydra's own steps, which raise what fails (its `@hydra.main` reports it and exits 1): an error raised outside
    `task_function` is the composition's (Hydra's, its callbacks' or a sweeper's), turned into its line here where
    it is a mistake in the overrides, composing again only then for the closest key; the job's own errors, and any
    other, Hydra reports as usual (a bug with its traceback). With Hydra's other flags (`--cfg`, `--help` ...)
    `@hydra.main` runs as it is."""
    from hydra import version
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import (
        create_automatic_config_search_path,
        detect_calling_file_or_module_from_task_function,
        detect_task_name,
    )
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    arguments = sys.argv[1:]
    if any(arg.startswith("-") and arg not in MULTIRUN_FLAGS for arg in arguments):
        hydra.main(version_base=VERSION_BASE, config_path=str(config_dir), config_name=config_name)(task_function)()
        return
    overrides = [arg for arg in arguments if arg not in MULTIRUN_FLAGS]
    version.setbase(VERSION_BASE)  # as @hydra.main(version_base=...): Hydra's 1.3 defaults (no chdir into the run)
    calling_file, calling_module = detect_calling_file_or_module_from_task_function(task_function)
    search_path = create_automatic_config_search_path(calling_file, calling_module, str(config_dir))
    task_name = detect_task_name(calling_file, calling_module)
    try:
        app = Hydra.create_main_hydra2(task_name=task_name, config_search_path=search_path)
        # As Hydra's _run_app: the config may choose the mode itself (hydra.mode: MULTIRUN in a search's config).
        mode, flag = app.get_mode(config_name=config_name, overrides=overrides), len(overrides) < len(arguments)
        if mode is None or (flag and mode == RunMode.RUN):
            mode = RunMode.MULTIRUN if flag else RunMode.RUN
            overrides = [*overrides, f"hydra.mode={mode.name}"]
        run = app.multirun if mode == RunMode.MULTIRUN else app.run
        run(config_name=config_name, task_function=task_function, overrides=overrides)
    except Exception as err:
        GlobalHydra.instance().clear()  # a Hydra of its own composes the closest key
        if not raised_in(task_function, err) and not tracebacks_asked():
            exit_on_composition_error(err, config_dir, config_name, [o for o in overrides if o not in MODES])
        report_as_hydra(err)
    finally:
        GlobalHydra.instance().clear()


def raised_in(function: Callable[..., Any], err: BaseException) -> bool:
    """Whether `err` was raised while `function` ran (one of its traceback's frames runs `function`'s code)."""
    code = inspect.unwrap(function).__code__
    return any(frame.f_code is code for frame, _ in traceback.walk_tb(err.__traceback__))


def report_as_hydra(err: Exception) -> None:
    """Report `err` as `@hydra.main` does: its traceback without Hydra's frames and exit code 1 (raised where the
    user set HYDRA_FULL_ERROR=1, or under a debugger)."""
    from hydra._internal.utils import run_and_report

    def reraise() -> None:
        raise err

    run_and_report(reraise)


def exit_on_composition_error(err: Exception, config_dir: Path, config_name: str, overrides: list[str]) -> None:
    """On an unknown key or group option behind Hydra's composition error `err` (composing `config_name` with
    `overrides`, a sweep's among them), `error: <message>` and exit 2."""

    def composed(given: list[str]) -> DictConfig:
        return compose_project(config_name, single_values(given), configs=config_dir)

    user_error = composition_error(err, composed, overrides, job=config_name)
    if user_error is not None:
        exit_with(user_error)


def single_values(overrides: list[str]) -> list[str]:
    """`overrides` without those that sweep (`seed=1,2`), which only a multirun takes: the config they vary."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    return [o for o in overrides if not parser.parse_override(o).is_sweep_override()]
