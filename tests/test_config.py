"""Every config option composes and builds; bad input gets one clear message."""

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import ROOT, in_process, start
from scaleup.engine.config import build_model, instantiate_each
from scaleup.engine.datamodule import apply_model_settings
from scaleup.engine.errors import UserError
from scaleup.engine.launch import register_resolvers

CONFIGS = ROOT / "configs"
PATHS = ["paths.root_dir=/tmp/scaleup-root", "paths.output_dir=/tmp/scaleup-out"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def composed(*overrides: str) -> dict:
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=[*PATHS, *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


@pytest.mark.parametrize(
    "override",
    [f"{group}={name}" for group in ("data", "model", "trainer", "logger", "experiment") for name in options(group)]
    + [f"model/optimizer={name}" for name in options("model/optimizer")],
)
def test_every_group_option_composes(override):
    cfg = composed(override)
    assert cfg["data"]["_target_"].startswith("scaleup.data.")
    assert (cfg["data"]["global_batch_size"] is None) != (cfg["data"]["per_device_batch_size"] is None)


@pytest.mark.parametrize("model", options("model"))
@pytest.mark.parametrize("optimizer", options("model/optimizer"))
def test_every_model_builds_with_every_optimizer(model, optimizer):
    data = "char_text" if model == "char_transformer" else "digits"
    cfg = composed(f"model={model}", f"model/optimizer={optimizer}", f"data={data}")
    apply_model_settings(cfg["model"], instantiate(cfg["data"]).model_settings())  # as train.py does
    module = build_model(cfg["model"])
    opt = module.configure_optimizers()
    assert [g["name"] for g in opt.param_groups] == ["decay", "no_decay"]
    assert opt.param_groups[1]["weight_decay"] == 0.0  # norms and biases are not decayed


# mlflow opens (and on first use creates) its tracking store when built: tests/test_loggers.py runs it for real.
@pytest.mark.parametrize("logger", [name for name in options("logger") if name != "mlflow"])
def test_loggers_and_callbacks_instantiate(logger):
    cfg = composed(f"logger={logger}")
    assert len(instantiate_each(cfg["logger"])) == {"none": 0, "many": 2}.get(logger, 1)
    names = [type(cb).__name__ for cb in instantiate_each(cfg["callbacks"])]
    assert names == [
        "ClassificationFigures",  # enabled by the classifier's model config
        "ModelCheckpoint",
        "ModelCheckpoint",
        "LearningRateMonitor",
        "TrainingDiagnostics",
        "RichProgressBar",
    ]


@pytest.fixture(scope="module")
def hydra_refusals(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """train.py with an unknown group option and with a misspelt key, started together (Hydra itself refuses
    them, before the job: only the real entry point shows what the user sees)."""
    tmp = tmp_path_factory.mktemp("refusals")
    cases = {"group": "data=mnist", "key": "trainer.devcies=2"}
    procs = {
        name: start([sys.executable, "train.py", override, f"hydra.run.dir={tmp / name}"])
        for name, override in cases.items()
    }
    return {name: subprocess.CompletedProcess(p.args, p.wait(60), p.communicate()[0]) for name, p in procs.items()}


@pytest.mark.slow
def test_unknown_group_option_is_one_clear_message(hydra_refusals):
    result = hydra_refusals["group"]
    assert result.returncode != 0
    assert "Could not find 'data/mnist'" in result.stdout and "digits" in result.stdout
    assert "Traceback" not in result.stdout


@pytest.mark.slow
def test_unknown_key_is_one_clear_message(hydra_refusals):
    result = hydra_refusals["key"]
    assert result.returncode != 0
    assert "Could not override 'trainer.devcies'" in result.stdout and "Traceback" not in result.stdout


def test_missing_imagefolder_data_is_one_clear_message(tmp_path):
    missing = Path(tmp_path) / "no-such-data"
    with pytest.raises(UserError) as raised:
        in_process(["data=imagefolder", f"data.root={missing}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert (
        str(raised.value) == f"no train/ directory under data.root={missing}: expected {missing}/train/<class>/<image>"
    )
