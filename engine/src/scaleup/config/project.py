"""Where a project's configs are: `configs/` in the folder its commands run from (where train.py is); a config
composed from them set up as the run `@hydra.main` would start; and the groups `--help` lists."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from scaleup.errors import UserError


def project_configs() -> Path:
    """The project's configs/ (its top configs and its own groups; the engine's are on Hydra's search path through
    its plugin, hydra_plugins/scaleup_searchpath)."""
    configs = Path.cwd() / "configs"
    if not (configs / "train.yaml").is_file():
        raise UserError(f"no configs/train.yaml in {Path.cwd()}: run it from your project's folder (train.py's)")
    return configs


def compose_project(
    job: str,
    overrides: Iterable[str] = (),
    *,
    configs: Path | None = None,
    job_name: str | None = None,
    hydra: bool = True,
) -> DictConfig:
    """configs/<job>.yaml of the project (`configs`, by default `project_configs()`) with `overrides`, as `python
    <job>.py` composes it: with Hydra's own config under `hydra` (for `hydra.job.name`: `job_name`, by default
    `job`), unless `hydra=False`."""
    from hydra import compose, initialize_config_dir

    where = str((configs or project_configs()).resolve())
    with initialize_config_dir(config_dir=where, version_base="1.3", job_name=job_name or job):
        return compose(job, overrides=list(overrides), return_hydra_config=hydra)


def project_packages(config: Mapping[str, Any] | None = None) -> list[str]:
    """Your package as your config names it: the top-level packages of the `model` and `data` `_target_`s of the
    train config `config`, by default of configs/train.yaml as it composes without overrides (the configs of the
    job that runs, else of the project in this folder); none where it does not compose. Where a checkpoint's stored
    targets are looked up after a rename (config/stored.py)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if config is None:
        try:
            config = OmegaConf.to_container(train_config_as_written(), resolve=False)
        except (HydraException, OmegaConfBaseException, UserError):
            return []
    nodes = [config.get(name) for name in ("model", "data")]
    targets = [str(node.get("_target_") or "") for node in nodes if isinstance(node, Mapping)]
    return list(dict.fromkeys(target.split(".")[0] for target in targets if target))


def train_config_as_written() -> DictConfig:
    """configs/train.yaml composed without overrides, from the configs of the job that runs (Hydra's primary config
    folder; `python eval.py` runs from any folder), else of the project in this folder. Hydra's compose API, on a
    Hydra of its own: the one `@hydra.main` set up (if any) is put aside meanwhile, and back afterwards."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    sources = HydraConfig.get().runtime.config_sources if HydraConfig.initialized() else []
    main = [source.path for source in sources if source.provider == "main" and source.schema == "file"]
    configs = Path(main[0]) if main else project_configs()
    running = GlobalHydra.instance().hydra if GlobalHydra.instance().is_initialized() else None
    GlobalHydra.instance().clear()  # initialize_config_dir refuses to start while a Hydra runs
    try:
        with initialize_config_dir(str(configs.resolve()), version_base="1.3"):
            return compose("train")
    finally:
        if running is not None:
            GlobalHydra.instance().initialize(running)


def set_up_run(cfg: DictConfig) -> Path:
    """Hydra's runtime for `cfg` (composed with its `hydra` node) as `@hydra.main` sets it up: the working directory,
    the run mode, `HydraConfig.get()`, and the run directory resolved once (its `${now:...}` stamped) into both
    `hydra.run.dir` and `hydra.runtime.output_dir`. Returns the run directory."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    with open_dict(cfg):
        cfg.hydra.runtime.cwd = os.getcwd()
        cfg.hydra.mode = RunMode.RUN
    HydraConfig.instance().set_config(cfg)  # for the ${hydra:...} interpolations in hydra.run.dir
    run_dir = Path(cfg.hydra.run.dir).resolve()
    with read_write(cfg.hydra):
        cfg.hydra.run.dir = cfg.hydra.runtime.output_dir = str(run_dir)
    HydraConfig.instance().set_config(cfg)
    return run_dir


def config_groups() -> str:
    """Every config group of the running app but Hydra's own, with its options: one `group: option, ...` line each,
    as Hydra's `--help` lists them ($APP_CONFIG_GROUPS), the groups that a `hydra.searchpath` of the project's adds
    included, which Hydra's own list leaves out: it reads the search path Hydra starts with (the project's configs/
    and the engine's groups), before the top config or the command line adds to it. For `hydra.help.template` (the
    engine's hydra/help/groups)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.object_type import ObjectType

    loader, hydra = GlobalHydra.instance().config_loader(), HydraConfig.get()

    def options(group: str, kind: ObjectType) -> list[str]:
        overrides = list(hydra.overrides.task)  # a hydra.searchpath given there counts too
        return sorted(loader.get_group_options(group, kind, config_name=hydra.job.config_name, overrides=overrides))

    listed, folders = {}, [group for group in options("", ObjectType.GROUP) if group != "hydra"]
    while folders:
        group = folders.pop()
        folders += [f"{group}/{inner}" for inner in options(group, ObjectType.GROUP)]
        if names := [name for name in options(group, ObjectType.CONFIG) if name[:1] != "_"]:  # _base: a shared part
            listed[group] = ", ".join(names)
    return "\n".join(f"{group}: {listed[group]}" for group in sorted(listed))
