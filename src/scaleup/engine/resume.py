"""Resuming a run: which checkpoint `ckpt_path` names, and whether it can continue under this plan."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_only

from scaleup.engine.checkpoint import exists, is_url, load_checkpoint, strip_wrapper_prefixes
from scaleup.engine.config import flatten
from scaleup.engine.errors import UserError
from scaleup.engine.plan import Plan

log = logging.getLogger("scaleup")


def resolve_ckpt_path(ckpt_path: str | None, checkpoint_dir: str, run_dir: Path) -> Path | str | None:
    """`last` is the run's newest checkpoint: `<checkpoint.dirpath>/last.ckpt`, or the hpc_ckpt_N.ckpt that
    Lightning saves in the run directory on SLURM's pre-emption signal if that is newer. With none yet it starts
    from scratch, so one command both starts a job and resumes it after a restart. Anything else must be a
    checkpoint file (or a URL such as s3://bucket/run/last.ckpt, read through fsspec)."""
    if ckpt_path != "last":
        return ckpt_path if ckpt_path is None or is_url(ckpt_path) else Path(ckpt_path)
    last = f"{checkpoint_dir.rstrip('/')}/last.ckpt"
    if is_url(last):
        return last if exists(last) else None
    candidates = [p for p in [Path(last), *run_dir.glob("hpc_ckpt_*.ckpt")] if p.is_file()]
    if not candidates:
        log.info(f"ckpt_path=last: no checkpoint in {checkpoint_dir} yet, starting from scratch")
        return None
    return max(candidates, key=lambda p: p.stat().st_mtime_ns)


def check_resume(path: Path, config: dict[str, Any], plan: Plan, model: L.LightningModule) -> None:
    """Open the checkpoint up front (clear errors, no traceback), refuse another network, report what changed.

    Runs before anything is written, so a bad resume leaves the run directory as it was.
    """
    checkpoint = load_checkpoint(path)
    if checkpoint.get("global_step", 0) >= plan.total_steps:
        raise UserError(
            f"{path} is at step {checkpoint['global_step']} (epoch {checkpoint.get('epoch')}), already at or past "
            f"this plan's {plan.total_steps} steps; raise trainer.max_epochs or trainer.max_steps to train further"
        )
    for name, state in checkpoint.get("callbacks", {}).items():
        if name.startswith("EarlyStopping") and state.get("stopping_reason_message"):
            raise UserError(
                f"{path} is from a run that early stopping ended at epoch {state['stopped_epoch']} "
                f"({state['stopping_reason_message'].strip()}); there is nothing to resume. To train on, start a new "
                "run, e.g. from these weights or with a larger callbacks.early_stopping.patience"
            )
    stored = checkpoint.get("scaleup", {})
    # Another network is one whose weights have other names or shapes; the config differences say why.
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    stored_shapes = {name: tuple(t.shape) for name, t in strip_wrapper_prefixes(checkpoint["state_dict"]).items()}
    if stored_shapes != shapes:
        before, now = flatten(stored.get("config", {}).get("model", {})), flatten(config["model"])
        diffs = [
            f"model.{k}={before.get(k)} (now {now.get(k)})" for k in sorted(before | now) if before.get(k) != now.get(k)
        ]
        changed = sorted(name for name in stored_shapes | shapes if stored_shapes.get(name) != shapes.get(name))
        raise UserError(
            f"{path} was trained with another network: {', '.join(diffs) or f'weights {changed[:3]} differ'}; "
            "resume with the same model settings, or start a new run"
        )
    if rank_zero_only.rank != 0:
        return
    previous = stored.get("plan", {})
    skipped = {"dataset_sizes", "sync_batchnorm_reason"}
    if plan.max_per_device_batch_size == "auto":  # settled again at the start of fit
        skipped |= {"per_device_batch_size", "accumulate_grad_batches", "bn_batch_size"}
    changed = [
        f"{key} {previous[key]} -> {value}"
        for key, value in plan.to_dict().items()
        if key in previous and previous[key] != value and key not in skipped
    ]
    log.info(f"resuming from {path}" + (f"; changed since: {', '.join(changed)}" if changed else ""))
    if "global_batch_size" in previous and previous["global_batch_size"] != plan.global_batch_size:
        log.warning(
            f"the global batch changed ({previous['global_batch_size']} -> {plan.global_batch_size}): "
            "the resumed run optimises differently from the original one"
        )
