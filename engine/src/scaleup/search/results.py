"""The search's answer: every trial (value, state, settings, run directory), the best settings as the command
that trains them again, and figures of the study, in `<sweep dir>/search.json`, on the log and in TensorBoard."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import matplotlib
import optuna

from scaleup.observability.rows import log_rows
from scaleup.search.space import SearchSpace, as_overrides
from scaleup.search.study import RUN_DIR

log = logging.getLogger("scaleup")

SEARCH_GROUP = "hparams_search"  # the config group that starts a search: not part of the command that trains again


def report(study: optuna.Study, sweep_dir: Path, space: SearchSpace, job: str) -> dict[str, Any]:
    """Log and write the study's trials and its best trial; draw its figures. Returns what search.json holds."""
    trials = [trial_row(trial) for trial in study.get_trials(deepcopy=False)]
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    best = None
    if complete:
        trial = study.best_trial
        shared = [o for o in space.fixed if o.partition("=")[0].lstrip("+~") != SEARCH_GROUP]
        best = {**trial_row(trial), "command": " ".join([f"python {job}.py", *shared, *as_overrides(trial.params)])}
    summary = {"study": study.study_name, "direction": study.direction.name.lower(), "best": best, "trials": trials}
    (sweep_dir / "search.json").write_text(json.dumps(summary, indent=2) + "\n")
    log_rows(
        f"search {study.study_name}: {len(trials)} trials ({sweep_dir / 'search.json'})",
        [(f"trial {t['number']}", describe(t)) for t in trials],
    )
    if best is None:
        log.warning("search: no trial completed")
    else:
        log.info(f"best: trial {best['number']} ({best['value']:.6g})\ntrain it again with: {best['command']}")
    draw_figures(study, sweep_dir)
    return summary


def trial_row(trial: optuna.trial.FrozenTrial) -> dict[str, Any]:
    return {
        "number": trial.number,
        "state": trial.state.name.lower(),
        "value": trial.value,
        "params": trial.params,
        "run_dir": trial.user_attrs.get(RUN_DIR),
    }


def describe(row: dict[str, Any]) -> str:
    value = "" if row["value"] is None else f"{row['value']:.6g}"
    return f"{row['state']:<8} {value:<10} {' '.join(as_overrides(row['params']))}  {row['run_dir'] or ''}"


def draw_figures(study: optuna.Study, sweep_dir: Path) -> None:
    """history.png (each trial's value and the best so far) and importance.png (how much each setting explains the
    values; from 2 complete trials on), also in TensorBoard under <sweep dir>/tensorboard."""
    from optuna.visualization import matplotlib as plots
    from torch.utils.tensorboard import SummaryWriter

    matplotlib.use("Agg")
    writer = SummaryWriter(str(sweep_dir / "tensorboard"))
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        writer.add_scalar("search/value", trial.value, trial.number)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        for name, plot in (("history", plots.plot_optimization_history), ("importance", plots.plot_param_importances)):
            try:
                figure = plot(study).figure
            except (ValueError, RuntimeError) as err:  # too few complete trials for it
                log.info(f"search: no {name} figure: {err}")
                continue
            figure.savefig(sweep_dir / f"{name}.png", bbox_inches="tight")
            writer.add_figure(f"search/{name}", figure)
    writer.close()
