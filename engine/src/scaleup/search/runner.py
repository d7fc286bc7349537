"""The search's loop: open (or reopen) the study, finish the trials a crash interrupted, launch new ones until the
study holds `n_trials`, and report. Each trial is an ordinary training job launched by Hydra's launcher."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from scaleup.config.sweep import first_mistake
from scaleup.errors import EXIT_USER_ERROR, UserError, as_user_error, new_directories, remove_refused_run
from scaleup.observability.rows import log_rows
from scaleup.search.results import report
from scaleup.search.space import SearchSpace, parse_space
from scaleup.search.study import (
    OVERRIDES,
    PRUNED_AT_STEP,
    RECIPE,
    best_value,
    open_storage,
    recipe,
    recipe_changes,
    storage_url,
)
from scaleup.search.trial import trial_overrides

log = logging.getLogger("scaleup")


@dataclass(frozen=True)
class SearchSettings:
    """`hydra.sweeper`'s keys (engine's conf/hydra/sweeper/search.yaml documents each)."""

    study_name: str
    storage: str | None
    n_trials: int
    n_jobs: int
    sampler: DictConfig
    pruner: DictConfig | None
    params: DictConfig

    def check(self) -> None:
        if not isinstance(self.study_name, str) or not self.study_name:
            raise UserError("hydra.sweeper.study_name: name the study (it names the sweep directory too)")
        for key in ("n_trials", "n_jobs"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise UserError(f"hydra.sweeper.{key}={getattr(self, key)} must be an integer >= 1")
        for key, node, arguments in (("sampler", self.sampler, {"seed": 0}), ("pruner", self.pruner, {})):
            try:
                if node is not None:
                    instantiate(node, **arguments)  # as each trial builds it
            except Exception as err:  # an unknown class or argument, a value the class refuses
                cause = err.__cause__ or err
                lines = str(cause).splitlines() or [""]
                reason = lines[-1] if isinstance(cause, ImportError) else f"{type(cause).__name__}: {lines[0]}"
                raise UserError(f"hydra.sweeper.{key}: {reason}") from err


class Search:
    """One search command: the study in `settings.storage`, the trials through `launcher`."""

    def __init__(self, settings: SearchSettings, config: DictConfig, launcher: Launcher) -> None:
        self.settings, self.config, self.launcher = settings, config, launcher
        self.sweep_dir = Path(config.hydra.sweep.dir)
        self.maximize = config.monitor.mode == "max"

    def run(self, arguments: list[str]) -> Any:
        """The search; a user mistake, in its settings or in a trial, is `error: <message>` and exit code 2."""
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # the search says what it does, and the table at the end
        try:
            return self.search(arguments)
        except UserError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)

    def search(self, arguments: list[str]) -> Any:
        """Check the settings and the space, open the study, finish its interrupted trials and launch new ones until
        it holds `n_trials`; report."""
        self.settings.check()
        space = parse_space(OmegaConf.to_container(self.settings.params) or {}, arguments)
        self.check(space)
        if self.config.dry_run:
            rows = [(key, repr(dist)) for key, dist in space.distributions.items()]
            log_rows("search space (dry run: no trial starts; each would be a run of its own)", rows)
            return None
        study = self.open_study(recipe(space.fixed))
        OmegaConf.save(self.config, self.sweep_dir / "multirun.yaml")
        for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            log.info(f"search: trial {trial.number} was interrupted; resuming it from its last checkpoint")
            self.launch(study, [(trial.number, [*trial.user_attrs[OVERRIDES], "ckpt_path=last"])])
        while (left := self.settings.n_trials - len(study.get_trials(deepcopy=False))) > 0:
            self.launch(study, [self.ask(study, space) for _ in range(min(self.settings.n_jobs, left))])
        return report(study, self.sweep_dir, space, self.config.hydra.job.config_name)

    def open_study(self, fixed: dict[str, str]) -> optuna.Study:
        """The study in the sweep directory's database (or `storage`), created on the first run and loaded on the
        next ones (the same command resumes it). A study belongs to the fixed recipe (`fixed`, study.recipe) it was
        made with: another one is refused, its trials would be ranked with trials they cannot be compared with (a study
        whose trials all failed takes the new one).
        Where the database cannot be opened, the directories made for it are removed."""
        created = new_directories(self.sweep_dir)
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        url, direction = storage_url(self.settings.storage, self.sweep_dir), "maximize" if self.maximize else "minimize"
        try:
            study = optuna.create_study(
                study_name=self.settings.study_name, storage=open_storage(url), direction=direction, load_if_exists=True
            )
        except Exception as err:  # a URL that is wrong or unreachable, a database driver that is not installed
            remove_refused_run(created)
            raise UserError(f"hydra.sweeper.storage: cannot open {url}: {str(err).splitlines()[0]}") from err
        if study.direction.name.lower() != direction:  # an earlier command's study, for the other monitor.mode
            raise UserError(
                f"the study {study.study_name} in {url} was made to {study.direction.name.lower()}; "
                f"monitor.mode={self.config.monitor.mode} would {direction}: name another hydra.sweeper.study_name"
            )
        # A new study, one made before studies kept their recipe, or one whose every trial failed (a mistake the
        # fixed command corrects): nothing to rank or resume with the recipe it had.
        kept = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.RUNNING)
        if RECIPE not in study.user_attrs or not study.get_trials(deepcopy=False, states=kept):
            study.set_user_attr(RECIPE, fixed)
        elif changes := recipe_changes(study.user_attrs[RECIPE], fixed):
            raise UserError(
                f"the study {study.study_name} in {url} was made with another fixed recipe: {', '.join(changes)}; "
                "its trials would be ranked with these: run it with the recipe it was made with, or name another "
                "hydra.sweeper.study_name"
            )
        return study

    def check(self, space: SearchSpace) -> None:
        """Compose, validate and plan (as a dry run) a trial at each corner of the space: a key that does not exist, a
        value of the wrong type or one the plan refuses is found before any trial starts."""
        jobs = [[*space.overrides(corner), *trial_overrides()] for corner in space.corners()]
        if (found := first_mistake(self.config.hydra.job.config_name, jobs)) is not None:
            raise UserError(f"search: {found[1]}")  # it names the key and the value

    def ask(self, study: optuna.Study, space: SearchSpace) -> tuple[int, list[str]]:
        """A new trial: its number and command line (kept in the study, for a resume). The sampler's seed for trial
        n is its `seed` + n: the same search draws the same values, also when a crash cut it in two (a sampler's
        random state is not in the database)."""
        number = len(study.get_trials(deepcopy=False))
        seed = self.settings.sampler.get("seed") or 0
        study.sampler = instantiate(self.settings.sampler, seed=seed + number)
        trial = study.ask(space.distributions)
        overrides = space.overrides(trial.params)
        trial.set_user_attr(OVERRIDES, overrides)
        return trial.number, overrides

    def launch(self, study: optuna.Study, trials: list[tuple[int, list[str]]]) -> None:
        """Run trials (number, command line) as jobs numbered as the trials (their run directories: <sweep
        dir>/<number>); tell the study how each ended. Trials launched together run at once where the launcher runs
        jobs in parallel. A trial ended by a user mistake (a metric the module does not log) stops the search: the
        next trials would end the same way."""
        batches: list[list[tuple[int, list[str]]]] = []  # consecutive trial numbers: one launch each
        for trial in trials:
            if batches and trial[0] == batches[-1][-1][0] + 1:
                batches[-1].append(trial)
            else:
                batches.append([trial])
        for batch in batches:
            jobs = [[*overrides, *trial_overrides()] for _, overrides in batch]
            returns = self.launcher.launch(jobs, initial_job_idx=batch[0][0])
            refused = [
                f"trial {number}: {mistake}"
                for (number, _), ret in zip(batch, returns, strict=True)
                if (mistake := self.tell(study, number, ret)) is not None
            ]
            if refused:
                raise UserError(
                    f"search: {refused[0]} (the trial is recorded as failed: once this is fixed, the same command goes "
                    "on with new trials)"
                )

    def tell(self, study: optuna.Study, number: int, ret: JobReturn) -> UserError | None:
        """Tell the study how trial `number` ended; returns the user mistake that ended it, if one did."""
        trial = study.get_trials(deepcopy=False)[number]
        if ret.status != JobStatus.COMPLETED:
            study.tell(number, state=optuna.trial.TrialState.FAIL)
            try:
                _ = ret.return_value  # raises the trial's error
            except Exception as err:
                if (mistake := as_user_error(err)) is not None:
                    return mistake
                log.warning(f"search: trial {number} failed: {failure(err, ret)}")
        elif PRUNED_AT_STEP in trial.user_attrs:
            study.tell(number, state=optuna.trial.TrialState.PRUNED)
        elif (value := best_value(trial, self.maximize)) is None:
            log.warning(f"search: trial {number} reported no finite value of {self.config.monitor.metric}")
            study.tell(number, state=optuna.trial.TrialState.FAIL)
        else:
            study.tell(number, value)
        return None


def failure(err: Exception, ret: JobReturn) -> str:
    """What ended a trial that is not a user mistake (a bug in the module, a crash): the error's type and first line,
    and the trial's log file, which holds its traceback (the launcher keeps only the error)."""
    first = (str(err).splitlines() or [""])[0]
    text = f"{type(err).__name__}: {first}" if first else type(err).__name__
    hydra = OmegaConf.select(ret.hydra_cfg, "hydra") if ret.hydra_cfg is not None else None
    log_file = None if hydra is None else Path(hydra.runtime.output_dir) / f"{hydra.job.name}.log"
    return f"{text} (its traceback: {log_file})" if log_file is not None and log_file.is_file() else text
