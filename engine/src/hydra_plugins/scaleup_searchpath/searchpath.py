"""Hydra's handle on the engine's config groups (trainer, strategy, callbacks, logger, lr_schedule, loader, paths,
hydra, debug): Hydra runs every SearchPathPlugin in this package before it composes a config, so a project's top
configs find the groups without naming them, and a `hydra.searchpath` of the project's own adds to them."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from scaleup.conf import SEARCHPATH


class EngineConfigGroups(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        """After the project's configs/ (whose own files come first) and before a `hydra.searchpath` of the
        project's, which Hydra appends later."""
        search_path.append(provider="scaleup", path=SEARCHPATH)
