"""What every run leaves on disk besides checkpoints: metrics.json, and the config inside each checkpoint."""

import json
import math
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_only

TEST_PREFIX = "test/"  # the final test's metrics: their presence in metrics.json says that the test ran to its end


def holds_test_results(path: Path) -> bool:
    """Whether `path` (a run's metrics.json) holds the final test's metrics."""
    return path.is_file() and any(name.startswith(TEST_PREFIX) for name in json.loads(path.read_text()))


class MetricsFile(L.Callback):
    """Merges the final value of every logged metric into `metrics.json` (rank 0, after fit and after test).

    Merging through the file, not an in-memory dict, keeps fit and test metrics together when each stage
    runs in its own processes (ddp_spawn starts new ones for `trainer.test`). At the end of fit it drops the test
    metrics that an earlier, shorter fit of the run left (a run trained further with `ckpt_path=last`): they belong
    to other weights, and until this fit's test writes its own, their absence tells a requeue that the test is still
    to run (checkpoints/resume.py).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def _write(self, trainer: L.Trainer, *, drop_test: bool = False) -> None:
        if rank_zero_only.rank != 0:
            return
        metrics = json.loads(self.path.read_text()) if self.path.is_file() else {}
        if drop_test:
            metrics = {name: value for name, value in metrics.items() if not name.startswith(TEST_PREFIX)}
        for name, value in trainer.callback_metrics.items():
            value = float(value)
            metrics[name] = value if math.isfinite(value) else str(value)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(dict(sorted(metrics.items())), indent=2) + "\n")

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer, drop_test=True)

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer)


class ConfigInCheckpoint(L.Callback):
    """Stores the resolved run config and plan (plain dicts) in each checkpoint, so `eval.py` and
    `export.py` rebuild the model and data without the user repeating the training overrides."""

    def __init__(self, config: dict[str, Any], plan: dict[str, Any]) -> None:
        self.config, self.plan = config, plan

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint["scaleup"] = {"config": self.config, "plan": self.plan}
