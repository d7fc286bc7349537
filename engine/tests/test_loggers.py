"""logger=wandb, logger=mlflow (offline, local) and logger=many: real loggers, one run kept across a requeue."""

import csv

import pytest

from conftest import QUICK, in_process
from scaleup.distributed.run_dir import run_id
from scaleup.observability.loggers import RUN_DIR_TAG


def test_run_id_depends_only_on_the_run_directory(tmp_path):
    assert run_id(tmp_path / "a") == run_id(tmp_path / "b" / ".." / "a")
    assert run_id(tmp_path / "a") != run_id(tmp_path / "b")


@pytest.mark.slow
def test_wandb_and_mlflow_continue_their_run_after_a_requeue(tmp_path):
    """A job that stops after epoch 1 and comes back in the same run directory (ckpt_path=last) logs into the
    same W&B run id and the same MLflow run; logger=many adds TensorBoard and CSV beside them."""
    run_dir, store = tmp_path / "run", f"sqlite:///{tmp_path}/mlflow.db"
    common = [
        *QUICK,
        "logger=[many,wandb,mlflow]",
        f"logger.mlflow.tracking_uri={store}",
        f"logger.mlflow.artifact_location={tmp_path}/artifacts",
        f"hydra.run.dir={run_dir}",
    ]
    in_process([*common, "trainer.max_epochs=1"])
    in_process([*common, "trainer.max_epochs=2", "ckpt_path=last"])

    # W&B offline: one directory per process start, all under the id the run directory gives.
    offline = sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(name.endswith(f"-{run_id(run_dir)}") for name in offline)

    from mlflow import MlflowClient  # here: importing MLflow costs every test process a second

    client = MlflowClient(store)
    (experiment,) = [e for e in client.search_experiments() if e.name == "scaleup"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.tags[RUN_DIR_TAG] == str(run_dir.resolve()) and run.info.run_name == "run"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/acc")] == [18, 37]  # epoch 1, epoch 2
    assert run.data.params["plan/global_batch_size"] == "64" and run.data.params["plan/world_size"] == "1"
    assert "test/acc" in run.data.metrics
    assert list((tmp_path / "artifacts").rglob("*.png"))  # test-time images, none in ./mlruns

    with open(run_dir / "csv" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert {"val/acc", "test/acc"} <= rows[0].keys()
    assert any(p.name.startswith("events.out.tfevents") for p in (run_dir / "tensorboard").iterdir())
