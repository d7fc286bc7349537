"""Hydra's handle on scaleup's hyperparameter search (`scaleup.search`): Hydra finds sweepers in this package.

Hydra imports every module here whenever it starts: this one imports nothing heavy until a search runs.
"""

from __future__ import annotations

import sys
from typing import Any

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class SearchSweeper(Sweeper):
    def __init__(self, **settings: Any) -> None:
        self.settings = settings

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        try:
            from scaleup.search.runner import Search, SearchSettings
        except ModuleNotFoundError as err:
            if err.name != "optuna":
                raise
            from scaleup.errors import EXIT_USER_ERROR

            print('error: a search needs Optuna: python -m pip install -e ".[search]"', file=sys.stderr)
            sys.exit(EXIT_USER_ERROR)

        launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )
        self.search = Search(SearchSettings(**self.settings), config, launcher)

    def sweep(self, arguments: list[str]) -> Any:
        return self.search.run(arguments)
