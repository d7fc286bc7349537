"""The evaluation job behind `python eval.py ckpt_path=PATH`: test a checkpoint on any device count."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import lightning as L
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from scaleup.callbacks.performance import PerformanceSettings, set_tf32
from scaleup.callbacks.run_files import MetricsFile
from scaleup.checkpoints.io import find_checkpoint, load_checkpoint, load_weights
from scaleup.compat.workarounds import ExactEvalMetrics
from scaleup.components import build_datamodule
from scaleup.config.plain import build_model, log_rows, to_plain
from scaleup.config.schema import validate_config
from scaleup.distributed.launch import check_launcher, shut_down_process_group
from scaleup.distributed.preemption import StopOnSigterm, exit_when_stopped
from scaleup.errors import UserError, config_errors
from scaleup.plan.topology import resolve_precision, resolve_topology

log = logging.getLogger("scaleup")


def stored_run(checkpoint: dict[str, Any], path: str) -> dict[str, Any]:
    """The config and plan `train.py` stored in the checkpoint."""
    if "scaleup" not in checkpoint or "state_dict" not in checkpoint:
        raise UserError(
            f"{path} was not written by this template's train.py (no stored config); load its state_dict "
            "with scaleup.checkpoints.io.load_weights instead"
        )
    return checkpoint["scaleup"]


def evaluate(cfg: DictConfig) -> dict[str, float]:
    """Rebuild model and data from the checkpoint's own config and run the test split."""
    validate_config(cfg, "eval")
    ckpt_path = find_checkpoint(cfg.ckpt_path, prefer="best")
    checkpoint = load_checkpoint(ckpt_path)
    stored = stored_run(checkpoint, ckpt_path)
    config, plan = stored["config"], stored["plan"]
    topology = resolve_topology(cfg.trainer)
    check_launcher(topology)

    data_cfg = {**config["data"], **to_plain(cfg.data)}
    # Same per-device batch as training by default: same batches, so the same float sums, to the last bit.
    data_cfg.update(global_batch_size=None, per_device_batch_size=cfg.batch_size or plan["per_device_batch_size"])
    datamodule = build_datamodule({**config, "data": data_cfg})
    # The plan stores the precision training resolved (`auto` became bf16-mixed, 16-mixed or 32-true there).
    precision = resolve_precision(cfg.trainer.precision or plan["precision"], topology.accelerator)
    if topology.accelerator == "cpu" and str(precision).startswith("16"):
        precision = "bf16-mixed"  # fp16 autocast needs a GPU; bf16 keeps the reduced-precision behaviour
    model = build_model(config["model"], precision=precision)
    load_weights(model, checkpoint["state_dict"])  # float64 weights into a float64 model: nothing rounded
    if cfg.compile:
        model.compile()  # in place: the module's forward, whatever the module
    del checkpoint

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    metrics_path = run_dir / "metrics.json"
    tf32, channels_last = plan.get("tf32", False), plan.get("channels_last", False)  # as trained
    set_tf32(tf32)
    stop = StopOnSigterm()
    with config_errors("trainer"):
        trainer = L.Trainer(
            accelerator=topology.accelerator,
            devices=topology.devices,
            num_nodes=topology.num_nodes,
            precision=precision,
            callbacks=[stop, ExactEvalMetrics(), MetricsFile(metrics_path), PerformanceSettings(tf32, channels_last)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=cfg.trainer.enable_progress_bar,
            default_root_dir=run_dir,
        )
    with exit_when_stopped(stop, f"evaluate again with: python eval.py ckpt_path={ckpt_path}"):
        trainer.test(model, datamodule=datamodule, verbose=False)
    shut_down_process_group()
    if not trainer.is_global_zero:
        return {}
    metrics = json.loads(metrics_path.read_text())
    rows = [(name, f"{value:.4f}") for name, value in metrics.items()]
    log_rows(f"{ckpt_path} on {topology.world_size} {topology.accelerator} process(es) ({run_dir})", rows)
    return metrics
