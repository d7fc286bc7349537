"""Hydra's handle on the engine's config groups (trainer, strategy, callbacks, logger, lr_schedule, loader, paths,
hydra, debug): Hydra runs every SearchPathPlugin in this package before it composes a config, so a project's top
configs find the groups without naming them, and a `hydra.searchpath` of the project's own adds to them."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from scaleup.conf import MADE, SEARCHPATH, group_values


class EngineConfigGroups(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        """After the project's configs/ (whose own files come first) and before a `hydra.searchpath` of the
        project's, which Hydra appends later."""
        search_path.append(provider="scaleup", path=SEARCHPATH)
        register_made_parts()


def register_made_parts() -> None:
    """The engine's shared group parts made from code (scaleup.conf.MADE: `trainer/_lightning`, every
    lightning.Trainer argument with Lightning's default), in Hydra's ConfigStore before any config is composed."""
    from hydra.core.config_store import ConfigStore

    for option in MADE:
        group, _, name = option.rpartition("/")
        ConfigStore.instance().store(group=group, name=name, node=group_values(option), provider="scaleup")
