"""Checks your project's own tests call: does your code keep the engine's contract (docs/contract.md)?

```python
from scaleup.testing import check_contract, check_equivalence, train_eval_resume

def test_my_task_keeps_the_contract():
    check_contract(["experiment=my_task"])

def test_my_task_trains_evaluates_and_resumes(tmp_path):
    train_eval_resume(tmp_path, ["experiment=my_task", "trainer.max_epochs=2"])

def test_my_task_trains_the_same_on_1_and_2_devices():
    check_equivalence(["experiment=my_task"])
```

Each takes the `key=value` overrides `python train.py` takes, and runs the project in `project` (the folder of
train.py and configs/; by default the current directory) with the engine's own code: a mistake fails the way
`python train.py` would fail on it, with the same message (a `scaleup.api.UserError`), and a broken promise fails
with an AssertionError that says which. The jobs run in this process (no interpreter start), on the CPU, on one
thread; only `check_equivalence` starts processes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.utilities.data import extract_batch_size
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from scaleup.config.project import compose_project, set_up_run
from scaleup.config.typed import train_config
from scaleup.distributed.run_dir import register_resolvers
from scaleup.errors import UserError, new_directories, remove_refused_run
from scaleup.modules import submodule

# The equivalence check, run as its command: an extra the core names only (docs/architecture.md).
EQUIVALENCE = "scaleup.check_equivalence"
# A short run on the CPU: what every helper adds before your overrides (which win).
QUICK = (
    "trainer.accelerator=cpu",
    "trainer.devices=1",
    "trainer.max_epochs=2",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "trainer.num_sanity_val_steps=0",
    "logger=none",
)


@contextlib.contextmanager
def _in_folder(project: str | Path | None) -> Iterator[Path]:
    """Run from `project` (relative paths in the configs, e.g. data/, resolve there), then go back."""
    before = Path.cwd()
    folder = Path(project or before).resolve()
    if not (folder / "configs" / "train.yaml").is_file():
        raise AssertionError(f"no configs/train.yaml in {folder}: pass project=<the folder of train.py>")
    os.chdir(folder)
    try:
        yield folder
    finally:
        os.chdir(before)


def compose(job: str, overrides: Sequence[str] = (), project: str | Path | None = None) -> DictConfig:
    """configs/<job>.yaml of `project` (the folder of train.py; by default the current directory), as `python <job>.py
    *overrides` composes it there (the last override of a key wins), with Hydra's runtime set up as `@hydra.main`
    sets it: `HydraConfig.get()` answers, the run directory (`hydra.run.dir`) exists. The `hydra` node is removed, as
    the job receives the config."""
    return _compose(job, overrides, project)[0]


def _compose(job: str, overrides: Sequence[str], project: str | Path | None) -> tuple[DictConfig, list[Path]]:
    """`compose`, and the directories it made for the run (`new_directories`: the run directory, then the parents
    it made)."""
    register_resolvers()
    by_key = {arg.split("=", 1)[0]: arg for arg in overrides}
    with _in_folder(project):
        cfg = compose_project(job, by_key.values())
        run_dir = set_up_run(cfg)
        created = new_directories(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
    with read_write(cfg), open_dict(cfg):
        del cfg["hydra"]
    return cfg, created


@contextlib.contextmanager
def _job_log(job: str) -> Iterator[None]:
    """What Hydra's job logging does for an entry point: INFO and up from every logger into <run dir>/<job>.log
    (where the job's config writes one: export logs to stdout only)."""
    hydra = HydraConfig.get()
    if OmegaConf.select(hydra, "job_logging.handlers.file") is None:
        yield
        return
    handler = logging.FileHandler(Path(hydra.runtime.output_dir) / f"{job}.log")
    handler.setFormatter(logging.Formatter(hydra.job_logging.formatters.simple.format))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        handler.close()


def run_job(job: str, overrides: Sequence[str] = (), project: str | Path | None = None) -> Any:
    """`python <job>.py *overrides` (job: train, eval or export) in this process, from `project`; returns what the
    job returns (train and eval: the final metrics; export: the file written). Pass `hydra.run.dir=DIR` among the
    overrides, or the run lands in the project's outputs/. A user mistake raises `UserError` (the entry point
    would print it and exit 2), and leaves no run directory it made, as the entry point. Torch runs on one thread, as
    a test's subprocesses do."""
    from scaleup.evaluate import evaluate
    from scaleup.export import export
    from scaleup.train import train

    threads = torch.get_num_threads()
    with _in_folder(project):
        cfg, created = _compose(job, overrides, None)
        torch.set_num_threads(1)
        try:
            with _job_log(job):
                return {"train": train, "eval": evaluate, "export": export}[job](cfg)
        except UserError:
            remove_refused_run(created)
            raise
        finally:
            torch.set_num_threads(threads)
            HydraConfig.instance().cfg = None


def check_contract(
    overrides: Sequence[str] = (), project: str | Path | None = None
) -> tuple[L.LightningDataModule, L.LightningModule]:
    """Build the project's DataModule and LightningModule from configs/train.yaml and `overrides` the way
    `python train.py` does, and check what the engine expects of them (docs/contract.md); returns both.

    First the engine's own start-up, as `python train.py dry_run=true` runs it: every config value's type and
    range, the plan (batch arithmetic, LR groups: `configure_optimizers` returns optimizers, never a scheduler).
    Then both built for real, the data prepared and set up, the model given what the data knows
    (`model_settings()`): the DataModule is a `GlobalBatchDataModule` with map-style, non-empty train, val and test
    splits; the first batch of its train loader (as one device loads it) has a batch size Lightning can read; the
    module has the submodule that export.py saves (`module=net` by default, configs/export.yaml).
    """
    from scaleup.build import build_data_and_model

    overrides = [*QUICK, *overrides]
    with _in_folder(project), tempfile.TemporaryDirectory(prefix="contract-") as run_dir:
        run_job("train", [*overrides, "dry_run=true", f"hydra.run.dir={run_dir}/plan"])
        config = train_config(compose("train", [*overrides, f"hydra.run.dir={run_dir}/build"]))  # resolved
        HydraConfig.instance().cfg = None  # what follows needs no Hydra
        L.seed_everything(config.seed, workers=True, verbose=False)
        datamodule, model, _ = build_data_and_model(config, Path(run_dir))
        problems = []
        for split in ("train", "val", "test"):
            dataset = datamodule.splits.get(split)
            if not hasattr(dataset, "__getitem__"):
                problems.append(f"build_splits()['{split}'] is {type(dataset).__name__}, not a map-style dataset")
            elif len(dataset) == 0:
                problems.append(f"build_splits()['{split}'] is empty")
        if not problems:
            batch = next(iter(datamodule.train_dataloader()))  # as one device loads it, with the engine's sampler
            try:
                extract_batch_size(batch)
            except Exception as err:
                problems.append(f"a training batch ({type(batch).__name__}) has no batch size Lightning reads: {err}")
        export_module = compose_project("export", hydra=False).module  # as `python export.py` composes it
        try:
            submodule(model, export_module)
        except Exception as err:
            problems.append(f"export.py's module={export_module}: {err}")
    if problems:
        raise AssertionError(f"{type(datamodule).__name__} / {type(model).__name__}:\n  " + "\n  ".join(problems))
    return datamodule, model


def train_eval_resume(
    tmp_path: str | Path, overrides: Sequence[str] = (), project: str | Path | None = None
) -> dict[str, Path]:
    """A short training run, then what users do with it, each checked: returns the run directories by name.

    - `train`: `python train.py` with `overrides` (2 epochs unless they say otherwise: use at least 2), which also
      keeps the checkpoint of every epoch. It must leave plan.json, metrics.json and checkpoints/last.ckpt, and
      count every evaluation sample once (`val/samples`, `test/samples` where the module logs them).
    - `eval`: `python eval.py` on the best checkpoint: the same test metrics as the training run's own test.
    - `export`: `python export.py` on it: a state_dict that loads with `torch.load(weights_only=True)`.
    - `resumed`: `python train.py ckpt_path=<the first epoch's checkpoint>`: it must end with the weights of the
      uninterrupted run (exactly, up to float rounding).
    """
    tmp_path = Path(tmp_path).resolve()
    runs = {name: tmp_path / name for name in ("train", "eval", "resumed")}
    epochs = tmp_path / "epochs"
    every_epoch = [
        "+callbacks.every_epoch._target_=lightning.pytorch.callbacks.ModelCheckpoint",
        f"+callbacks.every_epoch.dirpath={epochs}",
        "+callbacks.every_epoch.filename='epoch-{epoch}'",
        "+callbacks.every_epoch.auto_insert_metric_name=false",
        "+callbacks.every_epoch.save_top_k=-1",
        "+callbacks.every_epoch.monitor=step",  # told apart from the engine's own: a ModelCheckpoint's state key
        "+callbacks.every_epoch.mode=max",
    ]
    args = [*QUICK, *overrides]
    trained = run_job("train", [*args, *every_epoch, f"hydra.run.dir={runs['train']}"], project)
    missing = [
        name for name in ("plan.json", "metrics.json", "checkpoints/last.ckpt") if not (runs["train"] / name).exists()
    ]
    assert not missing, f"the training run left no {', '.join(missing)} in {runs['train']}"
    sizes = json.loads((runs["train"] / "plan.json").read_text())["dataset_sizes"]
    for split in ("val", "test"):
        counted, size = trained.get(f"{split}/samples"), sizes.get(split)
        assert counted in (None, size), f"{split}/samples={counted}, but the {split} split has {size} samples"

    best = next(
        iter(sorted((runs["train"] / "checkpoints").glob("best*.ckpt"))), runs["train"] / "checkpoints/last.ckpt"
    )
    evaluated = run_job(
        "eval", [f"ckpt_path={best}", "trainer.enable_progress_bar=false", f"hydra.run.dir={runs['eval']}"], project
    )
    tested = {name: value for name, value in trained.items() if name.startswith("test/")}
    differ = {
        name: (value, evaluated.get(name))
        for name, value in tested.items()
        if evaluated.get(name) is None or not math.isclose(value, evaluated[name], rel_tol=1e-6, abs_tol=1e-9)
    }
    assert not differ, f"eval.py on {best} gives other test metrics (training run, eval): {differ}"

    net = run_job("export", [f"ckpt_path={best}", f"output_path={tmp_path / 'net.pt'}"], project)
    assert torch.load(net, weights_only=True), f"export.py wrote an empty state_dict to {net}"

    first, *later = sorted(epochs.glob("epoch-*.ckpt"), key=lambda path: int(path.stem.split("-")[1]))
    assert later, f"the training run saved {first.name} only: pass trainer.max_epochs=2 or more, so a resume resumes"
    run_job("train", [*args, f"ckpt_path={first}", f"hydra.run.dir={runs['resumed']}"], project)
    uninterrupted, resumed = (
        torch.load(run / "checkpoints/last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
        for run in (runs["train"], runs["resumed"])
    )
    assert uninterrupted.keys() == resumed.keys(), "the resumed run's checkpoint holds other weights"
    for name, tensor in uninterrupted.items():
        torch.testing.assert_close(
            resumed[name], tensor, msg=lambda message, name=name: f"resumed from {first.name}: {name}: {message}"
        )
    return runs


def check_equivalence(overrides: Sequence[str] = (), project: str | Path | None = None, float32: bool = False) -> str:
    """`python -m scaleup.check_equivalence *overrides`: 8 steps on 2 CPU processes, on 1 accumulating 2
    micro-batches and on 1 with the whole batch, compared in float64 (or float32 with a loose tolerance). Fails
    with the check's verdict unless your module trains the same on 1 and on 2 devices; returns the verdict. The
    only helper here that starts processes (three `train.py` runs side by side, ~20 s on 2 cores)."""
    arguments = [*overrides, *(["--float32"] if float32 else [])]
    with _in_folder(project) as folder:
        done = subprocess.run(
            [sys.executable, "-m", EQUIVALENCE, *arguments],
            cwd=folder,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
        )
    assert done.returncode == 0, (
        f"python -m {EQUIVALENCE} {' '.join(overrides)} (exit {done.returncode}):\n{done.stdout}"
    )
    return done.stdout
