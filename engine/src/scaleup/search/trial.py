"""A training run that is a search's trial: it reports `monitor.metric` to the study after each validation and
stops when the pruner says so."""

from __future__ import annotations

from typing import Any

import lightning as L
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from scaleup.errors import SEARCH_TRIAL

# The callbacks entry that reports a trial to its study.
REPORT = "report_to_study"


def trial_overrides() -> list[str]:
    """What the search adds to each trial's command line: the trial's environment marks it as one (a user mistake
    is raised to the launcher, errors.exit_on_user_error), and its callbacks group reports to the study."""
    return [
        f"++hydra.job.env_set.{SEARCH_TRIAL}=1",
        f"++callbacks.{REPORT}={{_target_:{__name__}.report_to_study,metric:${{monitor.metric}}}}",
    ]


def report_to_study(metric: str) -> ReportToStudy:
    """The trial's ReportToStudy, from its Hydra config: the study, the trial's number and its run directory."""
    from scaleup.search.study import storage_url

    hydra = HydraConfig.get()
    return ReportToStudy(
        storage=storage_url(hydra.sweeper.storage, hydra.sweep.dir),
        study_name=hydra.sweeper.study_name,
        number=hydra.job.num,  # the search launches trial n as job n
        metric=metric,
        pruner=OmegaConf.to_container(hydra.sweeper.pruner, resolve=True) if hydra.sweeper.pruner else None,
        run_dir=hydra.runtime.output_dir,
    )


class ReportToStudy(L.Callback):
    """Rank 0 reports the monitored metric at each validation (by optimizer step) and asks the pruner; every rank
    stops at the same step when it prunes. Holds only plain values until `setup`, so that a spawning launcher can
    send it to its processes; the database is opened by rank 0 alone."""

    def __init__(
        self, storage: str, study_name: str, number: int, metric: str, pruner: dict[str, Any] | None, run_dir: str
    ) -> None:
        self.storage, self.study_name, self.number = storage, study_name, number
        self.metric, self.pruner, self.run_dir = metric, pruner, run_dir
        self.trial: Any = None
        self.reported: set[int] = set()

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or not trainer.is_global_zero:
            return
        import optuna
        from hydra.utils import instantiate

        from scaleup.search.study import RUN_DIR, open_storage

        pruner = instantiate(self.pruner) if self.pruner else optuna.pruners.NopPruner()
        storage = open_storage(self.storage)
        study = optuna.load_study(study_name=self.study_name, storage=storage, pruner=pruner)
        frozen = study.get_trials(deepcopy=False)[self.number]
        # Optuna gives a trial to report to only by its storage id (`Trial(study, trial_id)`), which the storage finds.
        study_id = storage.get_study_id_from_name(self.study_name)
        self.trial = optuna.trial.Trial(study, storage.get_trial_id_from_study_id_trial_number(study_id, self.number))
        self.trial.set_user_attr(RUN_DIR, self.run_dir)
        self.reported = set(frozen.intermediate_values)  # a resumed trial reported these steps before

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        prune = False
        if trainer.is_global_zero:
            prune = self.report(trainer)
        # Every rank stops at the same step: rank 0's decision, sent to all.
        if trainer.strategy.broadcast(prune, src=0):
            trainer.should_stop = True

    def report(self, trainer: L.Trainer) -> bool:
        from scaleup.search.study import PRUNED_AT_STEP

        value = trainer.callback_metrics.get(self.metric)
        step = trainer.global_step
        if value is None or step in self.reported:
            return False
        self.trial.report(float(value), step)
        self.reported.add(step)
        if not self.trial.should_prune():
            return False
        self.trial.set_user_attr(PRUNED_AT_STEP, step)
        return True
