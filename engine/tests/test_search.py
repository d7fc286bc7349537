"""The hyperparameter search (`python train.py hparams_search=digits_lr`, scaleup.search): an Optuna study in SQLite,
trials that are ordinary runs, resumed after kill -9, pruned on every rank at once, and the same trial for trial on
1 and 2 processes (float64)."""

import re
from concurrent.futures import ThreadPoolExecutor

import optuna
import pytest
import torch
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from conftest import QUICK, engine_option, in_process, read_json, run
from scaleup.errors import UserError
from scaleup.search.runner import SearchSettings
from scaleup.search.space import parse_space

# 2 epochs of 8 steps; val/loss (continuous: equal values mean equal runs); GroupNorm, so that the batch's split
# over devices changes nothing. The first trials are the sampler's random start-up draws (the same in every Optuna
# version); the threshold prunes trials 0 and 3 at their first validation (val/loss 2.300 and 2.328 there; trials 1
# and 2: 2.220 and 2.231).
SEARCH = [
    "hparams_search=digits_lr",
    *QUICK,
    "trainer.precision=64-true",
    "model.net.norm=group",
    "data.val_size=129",
    "data.test_size=1155",
    "monitor.metric=val/loss",
    "monitor.mode=min",
    "checkpoint.every_n_train_steps=5",
    "hydra.sweeper.pruner={_target_: optuna.pruners.ThresholdPruner, upper: 2.26}",
]
KILL = [  # kill -9 during trial 3 (number 2), at step 11: its last.ckpt is step 10's
    "+callbacks.kill._target_=probes.KillJobOnce",
    "+callbacks.kill.job=2",
    "+callbacks.kill.step=11",
]


def trials(sweep_dir):
    study = optuna.load_study(study_name="digits_lr", storage=f"sqlite:///{sweep_dir / 'study.db'}")
    return study.get_trials(deepcopy=False)


@pytest.fixture(scope="module")
def searches(tmp_path_factory):
    """A 4-trial search on 1 process, killed during trial 3 and run again; the first 2 trials on 2 processes."""
    root = tmp_path_factory.mktemp("search")
    one = [*SEARCH, *KILL, f"+callbacks.kill.marker={root}/killed", f"paths.log_dir={root}/one"]
    one.append("hydra.sweeper.n_trials=4")
    with ThreadPoolExecutor(1) as beside:  # the 2-process search shares nothing with the killed one
        two = beside.submit(
            run, [*SEARCH, f"paths.log_dir={root}/two", "hydra.sweeper.n_trials=2", "trainer.devices=2"], cwd=root
        )
        killed = run(one, cwd=root)
        states = [(t.number, t.state.name) for t in trials(root / "one" / "search" / "digits_lr")]
        resumed = run(one, cwd=root)
        two = two.result()
    return {"root": root, "one": one, "killed": killed, "states_after_kill": states, "resumed": resumed, "two": two}


@pytest.mark.slow
def test_a_killed_search_resumes_its_trial_and_ends_with_the_trials_asked(searches):
    assert searches["killed"].returncode == -9
    assert searches["states_after_kill"] == [(0, "PRUNED"), (1, "COMPLETE"), (2, "RUNNING")]
    assert searches["resumed"].returncode == 0, searches["resumed"].stderr[-3000:]
    sweep = searches["root"] / "one" / "search" / "digits_lr"
    assert [t.state.name for t in trials(sweep)] == ["PRUNED", "COMPLETE", "COMPLETE", "PRUNED"]
    assert f"resuming from {sweep / '2' / 'checkpoints' / 'last.ckpt'}" in (sweep / "2" / "train.log").read_text()
    assert torch.load(sweep / "2" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 16
    summary = read_json(sweep / "search.json")
    assert [t["run_dir"] for t in summary["trials"]] == [str(sweep / str(n)) for n in range(4)]
    best = min((t for t in summary["trials"] if t["state"] == "complete"), key=lambda t: t["value"])
    assert summary["best"]["number"] == best["number"]
    assert (sweep / "history.png").stat().st_size > 0 and (sweep / "importance.png").stat().st_size > 0
    # The best trial's command trains its settings (here planned only).
    command = summary["best"]["command"]
    assert command.startswith("python train.py ") and "hparams_search" not in command
    plan = in_process([*command.split()[2:], "dry_run=true", "~callbacks.kill", f"paths.log_dir={searches['root']}"])
    assert plan["global_batch_size"] == 64
    # Run again: a finished study reports again and starts nothing; asked the other way round, it is refused.
    again = run(searches["one"], cwd=searches["root"])
    assert again.returncode == 0 and "trial 3" in again.stderr + again.stdout
    assert [t.state.name for t in trials(sweep)] == ["PRUNED", "COMPLETE", "COMPLETE", "PRUNED"]
    refused = run([*searches["one"], "monitor.mode=max"], cwd=searches["root"])
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"error: the study digits_lr in sqlite:///{sweep / 'study.db'} was made to minimize; monitor.mode=max would "
        "maximize: name another hydra.sweeper.study_name"
    ]
    # Asked with another fixed recipe: refused, naming each key that changed, the study as it was.
    changed = run([*searches["one"], "trainer.max_epochs=1", "model.optimizer.momentum=0.8"], cwd=searches["root"])
    assert changed.returncode == 2
    assert changed.stderr.strip().splitlines() == [
        f"error: the study digits_lr in sqlite:///{sweep / 'study.db'} was made with another fixed recipe: "
        "model.optimizer.momentum ((default) -> 0.8), trainer.max_epochs (2 -> 1); its trials would be ranked with "
        "these: run it with the recipe it was made with, or name another hydra.sweeper.study_name"
    ]
    assert len(trials(sweep)) == 4


@pytest.mark.slow
def test_a_search_on_two_processes_is_the_same_trial_for_trial(searches):
    """The transfer: the same values, the same states (the pruner decided the same) and the same drawn settings;
    each trial a ddp_spawn job with its own clean run directory. The pruned trial stopped on both ranks at the step
    it was pruned at, and ran its test. The weights are equal to ~1e-13 (float64), and so is the metric (its
    states are float64 too, summed in another order on 2 ranks)."""
    assert searches["two"].returncode == 0, searches["two"].stderr[-3000:]
    root = searches["root"]
    one, two = (trials(root / name / "search" / "digits_lr") for name in ("one", "two"))
    assert [(t.state, t.params) for t in two] == [(t.state, t.params) for t in one[:2]], searches["two"].stderr[-3000:]
    for a, b in zip(one[:2], two, strict=True):
        assert a.intermediate_values.keys() == b.intermediate_values.keys()
        assert [b.intermediate_values[step] for step in a.intermediate_values] == pytest.approx(
            list(a.intermediate_values.values()), rel=1e-12
        )
    sweep = root / "two" / "search" / "digits_lr"
    for n in (0, 1):
        assert read_json(sweep / str(n) / "plan.json")["strategy"] == "ddp_spawn"
        assert [p.name for p in (sweep / str(n)).glob("*.log")] == ["train.log"]
        assert read_json(sweep / str(n) / "metrics.json")["test/samples"] == 1155
    assert two[0].user_attrs["pruned_at_step"] == 8
    assert torch.load(sweep / "0" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 8
    assert not (root / "outputs").exists()  # no stray run directory of a spawned process


@pytest.mark.slow
def test_a_trial_ended_by_a_user_mistake_is_failed_and_the_fixed_command_goes_on(tmp_path):
    """A mistake that shows only once a trial trains (a metric the module does not log: at its first validation)
    stops the search in one line, the trial recorded as failed; the same command with the mistake fixed goes on
    with new trials (the failed one is not resumed with its old overrides). A trial that a bug ends is failed, and
    the search goes on, its warning naming the error and the trial's log file, which holds the traceback."""
    tiny = ["trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1"]
    args = ["hparams_search=digits_lr", *QUICK, "trainer.max_epochs=1", *tiny, "hydra.sweeper.n_trials=3"]
    args.append(f"paths.log_dir={tmp_path}")
    refused = run([*args, "monitor.metric=val/nosuch"], cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert [line for line in refused.stderr.splitlines() if line.startswith("error:")] == [
        "error: search: trial 0: monitor.metric=val/nosuch is not logged by ImageClassifier, which logs val/acc, "
        "val/acc5, val/loss, val/samples: set monitor.metric (and monitor.mode=min|max) to one of them, e.g. in your "
        "experiment config (the trial is recorded as failed: once this is fixed, the same command goes on with new "
        "trials)"
    ]
    sweep = tmp_path / "search" / "digits_lr"
    assert [t.state.name for t in trials(sweep)] == ["FAIL"]
    bug = ["+callbacks.fail._target_=probes.FailOnRank", "+callbacks.fail.rank=0", "+callbacks.fail.step=1"]
    fixed = run([*args, *bug, "+callbacks.fail.job=1"], cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert "interrupted" not in fixed.stderr + fixed.stdout
    assert [t.state.name for t in trials(sweep)] == ["FAIL", "FAIL", "COMPLETE"]
    log_file = sweep / "1" / "train.log"
    assert (
        f"search: trial 1 failed: RuntimeError: injected failure on rank 0 at step 1 (its traceback: {log_file})"
        in fixed.stdout + fixed.stderr
    ), fixed.stderr[-3000:]
    assert "Traceback" in log_file.read_text() and "injected failure" in log_file.read_text()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.optimizer.lrr=interval(0.01,1.0)", "error: search: model.optimizer.lrr: there is no such key"),
        ("trainer.max_epochs=interval(1,3)", "error: search: trainer.max_epochs=1.0 must be an integer"),
        (
            "hydra.sweeper.storage=postgresql://nobody@127.0.0.1:1/db",
            "error: hydra.sweeper.storage: cannot open postgresql://nobody@127.0.0.1:1/db: ",
        ),
    ],
    ids=["unknown-key", "wrong-type", "storage"],
)
def test_a_bad_search_space_is_one_line_before_any_trial(override, message, tmp_path):
    """The space: found by composing and validating a trial at each corner of the space. The storage: a database
    that cannot be opened (here: no driver installed for it). Nothing is left behind."""
    result = run(["hparams_search=digits_lr", override, f"paths.log_dir={tmp_path}"], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().startswith(message) and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "search").exists()


def test_a_studys_recipe_leaves_out_where_files_go_the_topology_and_the_searchs_settings():
    """What a study is made with: the fixed overrides that change a trial's numbers; a later one of a key wins."""
    from scaleup.search.study import recipe, recipe_changes

    fixed = ["hparams_search=digits_lr", "trainer.max_epochs=2", "trainer.max_epochs=3", "~callbacks.kill"]
    same = [
        "trainer.devices=4",
        "trainer.num_nodes=2",
        "data.num_workers=8",
        "paths.log_dir=/x",
        "hydra.sweeper.n_trials=9",
    ]
    made_with = recipe(fixed)
    assert made_with == {"hparams_search": "digits_lr", "trainer.max_epochs": "3", "callbacks.kill": "(deleted)"}
    assert recipe(fixed + same) == made_with
    assert recipe_changes(made_with, recipe(fixed[:2])) == [
        "callbacks.kill ((deleted) -> (default))",
        "trainer.max_epochs (3 -> 2)",
    ]


@pytest.mark.parametrize(
    ("space", "message"),
    [
        ({"lr": "interval(1.0,0.1)"}, "search space: lr=interval(1.0,0.1): the interval's low end must be below"),
        ({"lr": "tag(log,interval(0,1))"}, "search space: lr=tag(log,interval(0,1)): a log scale needs a low end"),
        ({"lr": "choice([1,2],3)"}, "search space: lr=choice([1,2],3): a choice is a number, a string"),
        ({"lr": "interval(0.1"}, "search space: lr=interval(0.1"),
        ({}, "search space: nothing to search; set hydra.sweeper.params"),
    ],
    ids=["empty-interval", "log-from-0", "list-choice", "syntax", "empty"],
)
def test_a_space_that_draws_nothing_valid_is_refused(space, message):
    with pytest.raises(UserError) as raised:
        parse_space(space, ["trainer.max_epochs=1"])
    assert str(raised.value).startswith(message)


def test_the_space_is_drawn_as_written_and_each_draw_reads_back_as_drawn():
    space = parse_space(
        {"a": "tag(log,interval(1e-4,1e-1))", "b": "int(interval(8,64))", "c": "range(0,4)", "d": "x,'1',null"},
        ["+e=1"],
    )
    assert space.distributions == {
        "a": FloatDistribution(1e-4, 1e-1, log=True),
        "b": IntDistribution(8, 64),
        "c": IntDistribution(0, 3),
        "d": CategoricalDistribution(["x", "1", None]),
    }
    assert space.fixed == ["+e=1"]
    assert space.overrides({"a": 0.001, "d": "1"}) == ["+e=1", "a=0.001", "d='1'"]  # the string "1", not the int
    assert space.corners()[:2] == [{"a": 1e-4, "b": 8, "c": 0, "d": "x"}, {"a": 1e-1, "b": 64, "c": 3, "d": None}]
    # The command line over the config: a range replaced, a key pinned (out of the space).
    space = parse_space({"a": "interval(0.1,1.0)", "b": "choice(1,2)"}, ["a=interval(0.2,0.5)", "b=2"])
    assert space.distributions == {"a": FloatDistribution(0.2, 0.5)} and space.fixed == ["b=2"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"study_name": None}, "hydra.sweeper.study_name: name the study"),
        ({"n_trials": 0}, "hydra.sweeper.n_trials=0 must be an integer >= 1"),
        ({"sampler": {"_target_": "optuna.samplers.Nope"}}, "hydra.sweeper.sampler: Are you sure that 'Nope' is"),
        (
            {"pruner": {"_target_": "optuna.pruners.MedianPruner", "n_warmup_steps": -1}},
            "hydra.sweeper.pruner: ValueError: Number of warmup steps cannot be negative",
        ),
    ],
    ids=["no-name", "no-trials", "unknown-sampler", "bad-pruner"],
)
def test_search_settings_that_cannot_work_are_refused(change, message):
    """Checked before the space and before anything is written (the sampler and the pruner built once here)."""
    settings = {
        **engine_option("hydra/sweeper/search", study_name="digits_lr", params={}),
        **change,
    }
    fields = {key: OmegaConf.create(v) if isinstance(v, dict) else v for key, v in settings.items() if key[0] != "_"}
    with pytest.raises(UserError) as raised:
        SearchSettings(**fields).check()
    assert str(raised.value).startswith(message)


@pytest.mark.slow
def test_trials_launched_together_run_at_once_through_submitit(tmp_path):
    """`hydra/launcher=submitit_local hydra.sweeper.n_jobs=2`: both trials are submitit jobs running at the same
    time, each reporting to the one SQLite database; each its own run directory, numbered as its trial."""
    args = ["hparams_search=digits_lr", *QUICK, "trainer.max_epochs=1", f"paths.log_dir={tmp_path}"]
    result = run([*args, "hydra/launcher=submitit_local", "hydra.sweeper.n_jobs=2", "hydra.sweeper.n_trials=2"])
    assert result.returncode == 0, result.stderr[-3000:]
    sweep = tmp_path / "search" / "digits_lr"
    first, second = trials(sweep)
    assert [t.state.name for t in (first, second)] == ["COMPLETE", "COMPLETE"]
    assert [t.user_attrs["run_dir"] for t in (first, second)] == [str(sweep / "0"), str(sweep / "1")]
    assert len(list((sweep / ".submitit").glob("*/*_result.pkl"))) == 2
    # At once: each trial's log begins before the other's ends (its lines' timestamps: "[2026-12-03 16:45:02,818]").
    stamps = [re.findall(r"^\[(\d{4}-[\d-]+ [\d:,]+)\]", (sweep / n / "train.log").read_text(), re.M) for n in "01"]
    assert stamps[1][0] < stamps[0][-1] and stamps[0][0] < stamps[1][-1], stamps
