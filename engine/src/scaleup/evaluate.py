"""The evaluation job behind `python eval.py ckpt_path=PATH`: test a checkpoint on any device count."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from scaleup.build import build_datamodule, build_model
from scaleup.checkpoints.io import find_checkpoint, load_checkpoint, load_weights
from scaleup.config.stored import stored_run
from scaleup.config.typed import eval_config
from scaleup.distributed.launch import check_launcher
from scaleup.distributed.process_group import shut_down_process_group
from scaleup.observability.rows import log_rows
from scaleup.plan.topology import resolve_precision, resolve_topology
from scaleup.trainer import build_eval_trainer

log = logging.getLogger("scaleup")


def evaluate(cfg: DictConfig) -> dict[str, float]:
    """Rebuild model and data from the checkpoint's own config and run the test split."""
    config = eval_config(cfg)
    ckpt_path = find_checkpoint(config.ckpt_path, prefer="best")
    checkpoint = load_checkpoint(ckpt_path)
    stored = stored_run(checkpoint, ckpt_path)
    plan = stored.plan
    topology = resolve_topology(config.trainer)
    check_launcher(topology)

    data_cfg = {**stored.data, **config.data}
    # Same per-device batch as training by default: same batches, so the same float sums, to the last bit.
    data_cfg.update(global_batch_size=None, per_device_batch_size=config.batch_size or plan.per_device_batch_size)
    datamodule = build_datamodule(data_cfg, stored.loader, stored.seed)
    # The plan stores the precision training resolved (`auto` became bf16-mixed, 16-mixed or 32-true there).
    precision = resolve_precision(config.trainer.precision or plan.precision, topology.accelerator)
    if topology.accelerator == "cpu" and str(precision).startswith("16"):
        precision = "bf16-mixed"  # fp16 autocast needs a GPU; bf16 keeps the reduced-precision behaviour
    model = build_model(stored.model, precision=precision)
    load_weights(model, checkpoint["state_dict"])  # float64 weights into a float64 model: nothing rounded
    if config.compile:
        model.compile()  # in place: the module's forward, whatever the module
    del checkpoint

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    job = build_eval_trainer(topology, precision, plan, run_dir, config.trainer.enable_progress_bar)
    with job.running(f"evaluate again with: python eval.py ckpt_path={ckpt_path}"):
        job.trainer.test(model, datamodule=datamodule, verbose=False)
    shut_down_process_group()
    if not job.trainer.is_global_zero:
        return {}
    metrics = json.loads((run_dir / "metrics.json").read_text())
    rows = [(name, f"{value:.4f}") for name, value in metrics.items()]
    log_rows(f"{ckpt_path} on {topology.world_size} {topology.accelerator} process(es) ({run_dir})", rows)
    return metrics
