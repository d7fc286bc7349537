"""Every config option composes and builds; bad input gets one clear message."""

import inspect
import os
import time

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf
from test_adopted import write_mnist

from conftest import (
    ENGINE_CONF,
    PROJECT,
    ROOT,
    check,
    clean_env,
    config_groups,
    engine_option,
    in_process,
    read_json,
    run,
)
from scaleup.build import build_model
from scaleup.config.plain import instantiate_each
from scaleup.data.datamodule import apply_model_settings
from scaleup.distributed.run_dir import register_resolvers
from scaleup.errors import UserError

CONFIGS = PROJECT / "configs"
PATHS = ["paths.root_dir=/tmp/scaleup-root", "paths.output_dir=/tmp/scaleup-out"]


# Every config group a user can swap, and its options (paths and hydra hold the run directory, not a choice;
# hparams_search turns a run into a search: test_search.py runs it).
GROUPS = {
    group: [path.stem for path in files]
    for group, files in config_groups().items()
    if group.split("/")[0] not in ("paths", "hydra", "hparams_search")  # hydra/launcher: how a sweep starts
}


# The models of the template's interface (`net` and `optimizer`, the suite's testbed.models); the others are users'
# modules of their own shapes (an autoencoder, a GAN, lightning-hydra-template's module).
OTHER_SHAPES = ("user_modules.", "testbed.lht_mnist.")
CLASSIFIERS = [
    name
    for name in GROUPS["model"]
    if not str(OmegaConf.load(CONFIGS / "model" / f"{name}.yaml").get("_target_", "")).startswith(OTHER_SHAPES)
]


def composed(*overrides: str) -> dict:
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=[*PATHS, *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


def test_the_groups_are_the_documented_ones():
    assert set(GROUPS) == {
        "callbacks",
        "data",
        "debug",
        "experiment",
        "init",
        "loader",
        "logger",
        "lr_schedule",
        "model",
        "model/optimizer",
        "strategy",
        "trainer",
    }


@pytest.mark.slow  # about 140 dry runs: 20-40 s
def test_every_option_of_every_group_dry_runs_with_every_experiment(tmp_path):
    """Each option of each group, alone and with each experiment, plans a run (a dry run: data sizes, the model
    on the meta device, the strategy, the plan), or is refused in one message for a real incompatibility: text
    data with an image model (or the reverse), or ImageNet's global batch of 8192 on a smaller training set."""
    broken, refused = [], []
    write_mnist(tmp_path / "data")  # the files data=lht_mnist reads, as torchvision writes them
    for experiment in [None, *GROUPS["experiment"]]:
        for group, names in GROUPS.items():
            for name in CLASSIFIERS if group == "model" else names:
                if group == "experiment" or (group == "debug" and name == "default"):
                    continue
                args = [f"{group}={name}", *([f"experiment={experiment}"] if experiment else [])]
                run_dir = tmp_path / f"{experiment}-{group.replace('/', '-')}-{name}"
                try:
                    plan = in_process(
                        [*args, "dry_run=true", f"paths.data_dir={tmp_path / 'data'}", f"hydra.run.dir={run_dir}"]
                    )
                except UserError as err:
                    expected = ("does not fit the data", "is larger than the training set", "does not give it")
                    (refused if any(reason in str(err) for reason in expected) else broken).append(f"{args}: {err}")
                    continue
                if plan["global_batch_size"] < 1:
                    broken.append(f"{args}: planned a global batch of {plan['global_batch_size']}")
    assert not broken, "\n".join(broken)
    assert any("is larger than the training set" in line for line in refused), refused


@pytest.mark.parametrize("callbacks", ["[]", "[early_stopping]", "[default,ema]", "[default,early_stopping,ema]"])
def test_any_callbacks_list_plans_a_run(callbacks, tmp_path):
    plan = in_process([f"callbacks={callbacks}", "dry_run=true", f"hydra.run.dir={tmp_path}"])
    assert plan["lr"] == pytest.approx(0.1) and plan["total_steps"] == 12 * 19
    assert (plan["early_stopping_monitor"] is not None) == ("early_stopping" in callbacks)


@pytest.mark.parametrize("model", CLASSIFIERS)
@pytest.mark.parametrize("optimizer", GROUPS["model/optimizer"])
def test_every_model_builds_with_every_optimizer(model, optimizer):
    cfg = composed(f"model={model}", f"model/optimizer={optimizer}")
    apply_model_settings(cfg["model"], instantiate(cfg["data"]).model_settings())  # as train.py does
    module = build_model(cfg["model"])
    opt = module.configure_optimizers()
    assert [g["name"] for g in opt.param_groups] == ["decay", "no_decay"]
    assert opt.param_groups[1]["weight_decay"] == 0.0  # norms and biases are not decayed


def test_the_default_bar_updates_as_often_as_it_draws_and_ends_each_epoch_full(tmp_path):
    """40 steps of well under a quarter second each: the training bar reads the metrics at the first step, about
    every quarter second and at the epoch's last step (Lightning's, after every step), and each epoch's bar ends at
    40 of 40."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    from scaleup.callbacks.progress import SteadyRichProgressBar

    class CountingBar(SteadyRichProgressBar):
        reads, completed = 0, []

        def get_metrics(self, trainer, pl_module):
            self.reads += 1
            return super().get_metrics(trainer, pl_module)

        def on_train_epoch_end(self, trainer, pl_module):
            self.completed.append(self.progress.tasks[self.train_progress_bar_id].completed)
            super().on_train_epoch_end(trainer, pl_module)

    bar = CountingBar()
    trainer = L.Trainer(
        max_epochs=2, limit_train_batches=40, limit_val_batches=0, callbacks=[bar], logger=False,
        enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    started = time.monotonic()
    trainer.fit(BoringModel())
    quarter_seconds = (time.monotonic() - started) / 0.25
    assert bar.completed == [40, 40]
    # per epoch: the first and the last step, one per quarter second between them, the epoch's end
    assert bar.reads <= 2 * 3 + quarter_seconds + 1, (bar.reads, quarter_seconds)
    trainer = L.Trainer(
        max_steps=3, callbacks=[SteadyRichProgressBar(refresh_rate=0)], logger=False, enable_checkpointing=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(BoringModel())  # refresh_rate=0: Lightning's bar turned off, as Lightning's own
    assert trainer.global_step == 3


@pytest.mark.slow  # an end-to-end run
def test_no_progress_bar_among_the_callbacks_gets_the_default_one(tmp_path):
    """callbacks=[] with the bar on: Lightning would add its TQDM bar, which redraws after every step. And
    logger=[] (an empty list of the group, which leaves no logger key at all) trains with no logger."""
    names = tmp_path / "callbacks.json"
    in_process(
        [
            "callbacks=[]",
            "logger=[]",
            "trainer.max_steps=1",
            "trainer.limit_val_batches=1",
            "trainer.limit_test_batches=1",
            "trainer.num_sanity_val_steps=0",
            "+callbacks.names._target_=probes.CallbackNames",
            f"+callbacks.names.out={names}",
            f"hydra.run.dir={tmp_path}",
        ]
    )
    callbacks = read_json(names)
    assert "SteadyRichProgressBar" in callbacks and "TQDMProgressBar" not in callbacks


# mlflow opens (and on first use creates) its tracking store when built: engine/tests/test_loggers.py runs it for real.
@pytest.mark.parametrize("logger", [name for name in GROUPS["logger"] if name != "mlflow"])
def test_loggers_and_callbacks_instantiate(logger):
    cfg = composed(f"logger={logger}")
    assert len(instantiate_each(cfg["logger"])) == {"none": 0, "many": 2}.get(logger, 1)
    names = [type(cb).__name__ for cb in instantiate_each(cfg["callbacks"])]
    assert names == ["LearningRateMonitor", "TrainingDiagnostics", "SteadyRichProgressBar"]


def test_trainer_group_holds_every_trainer_argument_the_template_does_not_set():
    """`trainer.<any Trainer argument>=VALUE` works as typed (no `+`), and nothing else is in the group."""
    template_sets = {"strategy", "logger", "callbacks", "plugins", "default_root_dir", "enable_checkpointing"}
    template_sets.add("use_distributed_sampler")
    arguments = set(inspect.signature(L.Trainer.__init__).parameters) - {"self"} - template_sets
    assert set(composed()["trainer"]) == arguments
    assert composed("trainer.max_time=00:00:01:00")["trainer"]["max_time"] == "00:00:01:00"  # a key not in the YAML


def test_the_trainer_group_restates_none_of_lightnings_defaults():
    """conf/trainer/default.yaml holds only what the template changes: each of its keys differs from
    lightning.Trainer's own default, which the group takes from Lightning's signature for every other argument."""
    lightning = {name: p.default for name, p in inspect.signature(L.Trainer.__init__).parameters.items()}
    own = OmegaConf.to_container(OmegaConf.load(ENGINE_CONF / "trainer" / "default.yaml"))
    own.pop("defaults", None)
    restated = {name: value for name, value in own.items() if value == lightning[name]}
    assert not restated, f"trainer/default.yaml restates Lightning's defaults: {restated}"
    assert {name: composed()["trainer"][name] for name in ("max_steps", "max_time", "inference_mode")} == {
        name: lightning[name] for name in ("max_steps", "max_time", "inference_mode")
    }


# The input each image data option yields: (channels, height, width).
IMAGE_SHAPES = {
    "digits": (1, 8, 8),
    "synthetic": (3, 32, 32),
    "synthetic_imagenet": (3, 224, 224),
}


@pytest.mark.slow  # 30 dry runs: about 10 s
@pytest.mark.parametrize("data", sorted(IMAGE_SHAPES))
def test_every_image_data_option_fits_every_image_model(data, tmp_path):
    """Each data= with each image model= plans, and the model the plan made takes the data's images: the data
    fills in the input channels and the classes (a forward pass on the meta device checks the shapes)."""
    for model in CLASSIFIERS:
        plan = in_process([f"data={data}", f"model={model}", "dry_run=true", f"hydra.run.dir={tmp_path / model}"])
        cfg = OmegaConf.to_container(OmegaConf.load(tmp_path / model / "config.yaml"))
        net_cfg = cfg["model"]["net"]
        assert net_cfg["in_channels"] == IMAGE_SHAPES[data][0], (data, model)
        with torch.device("meta"):
            logits = instantiate(net_cfg)(torch.empty(2, *IMAGE_SHAPES[data]))
        assert logits.shape == (2, net_cfg["num_classes"]) and plan["global_batch_size"] > 0, (data, model)


@pytest.mark.slow  # the entry point in a process of its own
def test_train_help_lists_every_group_the_engines_too():
    """`python train.py --help` lists every config group with its options: the project's and the engine's (trainer,
    strategy, callbacks, logger, lr_schedule, loader, debug, paths), on Hydra's search path through the engine's
    plugin. Hydra's own groups (hydra/...) are --hydra-help's."""
    shown = check(run(["--help"])).stdout
    listed = shown.split("(group=option)\n\n", 1)[1].split("\n\n== Config ==", 1)[0].splitlines()
    groups = {group: files for group, files in config_groups().items() if not group.startswith("hydra")}
    assert listed == [f"{group}: {', '.join(f.stem for f in groups[group])}" for group in sorted(groups)]
    assert {"trainer", "strategy", "lr_schedule", "callbacks", "logger", "loader", "debug", "data"} <= set(groups)


def test_a_search_path_of_your_own_adds_to_the_engines_groups(tmp_path):
    """The engine's config groups are on Hydra's search path through the engine's plugin
    (hydra_plugins/scaleup_searchpath), not through the top config: a `hydra.searchpath` of the user's adds an option
    beside them (it replaced the top config's list, which held them), and the line top configs held before,
    pkg://scaleup.conf, changes nothing."""
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "short.yaml").write_text("defaults: [default, _self_]\nmax_epochs: 2\n")
    for searchpath in (f"[file://{tmp_path}]", f"[pkg://scaleup.conf,file://{tmp_path}]"):
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3", job_name="train"):
            cfg = compose("train", [f"hydra.searchpath={searchpath}", "trainer=short"])
        assert (cfg.trainer.max_epochs, cfg.trainer.accelerator, cfg.strategy.name) == (2, "auto", "ddp")


@pytest.mark.slow  # a process of its own: Hydra finds its plugins once per process
def test_engine_groups_off_the_search_path_are_one_line(tmp_path):
    """A `hydra_plugins` package with an __init__.py first on the path hides the engine's plugin
    (hydra_plugins/scaleup_searchpath), so none of the engine's groups are found: one line naming what hides it and
    the fix, exit 2, no run directory; not Hydra's `hydra=default: there is no such option (the options: config)`."""
    shadow = tmp_path / "elsewhere" / "hydra_plugins"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(shadow.parent), env["PYTHONPATH"]])
    result = run(["dry_run=true", f"hydra.run.dir={tmp_path / 'run'}"], env=env)
    assert (result.returncode, result.stderr) == (
        2,
        "error: the engine's config groups (callbacks, debug, hydra, init, loader, logger, lr_schedule, paths, "
        "strategy, trainer) are not on Hydra's search path: Hydra did not find the engine's plugin "
        f"hydra_plugins/scaleup_searchpath: {shadow / '__init__.py'} hides it; delete that __init__.py (Hydra's "
        "plugins share the name)\n",
    )
    assert not (tmp_path / "run").exists()


def test_eval_help_shows_its_config_not_the_training_groups():
    """`python eval.py --help` would list the training groups of configs/, which eval.py then refuses."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3", job_name="eval"):
        cfg = compose("eval", return_hydra_config=True)
    template = cfg.hydra.help.template
    assert "$CONFIG" in template and "$APP_CONFIG_GROUPS" not in template and "+data.KEY=VALUE" in template


# The template's own settings, each said once where it is set: the group files it owns (Lightning's Trainer
# arguments and Hydra's launchers are documented by their projects), and its sections of the top config.
OWN_GROUPS = (
    "lr_schedule/linear",
    "strategy/_base",
    "strategy/ddp",
    "strategy/fsdp",
    "loader/default",
    "init/default",
    "paths/default",
)
OWN_SECTIONS = ("monitor", "checkpoint", "performance")


def undocumented(lines: list[str], indent: str = "") -> list[str]:
    """The keys at `indent` in YAML `lines` with neither a comment on their line nor a comment line just above."""
    keys = []
    for i, line in enumerate(lines):
        key, colon, rest = line.partition(":")
        if colon and key.startswith(indent) and key[len(indent) :].isidentifier() and key != "defaults":
            above = lines[i - 1].strip() if i else ""
            if "#" not in rest and not above.startswith("#"):
                keys.append(key.strip())
    return keys


def test_every_setting_of_the_templates_own_sections_says_what_it_does():
    """A setting's type is checked (config/schema.py), its default is its group file's (test_docs checks the
    reference against it), and what it does is said there too: a comment on its line or just above it."""
    missing = {
        option: keys
        for option in OWN_GROUPS
        if (keys := undocumented((ENGINE_CONF / f"{option}.yaml").read_text().splitlines()))
    }
    top = (ROOT / "configs" / "train.yaml").read_text().splitlines()
    for section in OWN_SECTIONS:
        start = top.index(f"{section}:")
        block = [top[start + 1]]
        for line in top[start + 2 :]:
            if line and not line.startswith(" "):
                break
            block.append(line)
        if keys := undocumented(block, indent="  "):
            missing[section] = keys
    assert not missing, missing


def test_the_strategy_options_shared_defaults_are_stated_once():
    """strategy.timeout_minutes and strategy.hang_timeout_minutes are strategy/_base.yaml's alone: each option
    composes them from there without restating them, the schema holds no default of its own, and eval.py's job (no
    strategy section) watches hangs with the same bound."""
    from scaleup.config.schema import Strategy
    from scaleup.trainer import HANG_TIMEOUT_MINUTES

    shared = engine_option("strategy/_base")
    assert shared == {"timeout_minutes": 30, "hang_timeout_minutes": 5}
    for option in ("ddp", "fsdp"):
        own = OmegaConf.load(ENGINE_CONF / "strategy" / f"{option}.yaml")
        assert not set(shared) & set(own), f"strategy/{option}.yaml restates {set(shared) & set(own)}"
        assert {key: composed(f"strategy={option}")["strategy"][key] for key in shared} == shared
    assert all(Strategy.model_fields[key].is_required() for key in shared)
    assert shared["hang_timeout_minutes"] == HANG_TIMEOUT_MINUTES


def test_the_loader_groups_defaults_are_stated_once():
    """The shared DataLoader settings' defaults are conf/loader/default.yaml's alone: GlobalBatchDataModule's
    arguments take theirs from it (a module built without Hydra gets what a run gets), stating no value of their
    own."""
    import ast

    from scaleup.data.datamodule import GlobalBatchDataModule

    shared = engine_option("loader/default")
    init = ast.parse(inspect.getsource(GlobalBatchDataModule)).body[0].body
    arguments = next(node.args for node in init if getattr(node, "name", None) == "__init__")
    given = dict(zip([a.arg for a in arguments.args][-len(arguments.defaults) :], arguments.defaults, strict=True))
    restated = [name for name in shared if isinstance(given[name], ast.Constant)]
    assert not restated, f"GlobalBatchDataModule.__init__ restates the loader group's {restated}"
    module = GlobalBatchDataModule(global_batch_size=8)
    assert {name: getattr(module, name) for name in shared} == shared
