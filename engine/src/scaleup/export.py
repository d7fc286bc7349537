"""The export job behind `python export.py`: one network's weights as a plain state_dict, in torch.save's format or,
for an output_path ending in .safetensors, in the safetensors format."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from scaleup.build import build_model
from scaleup.checkpoints.io import (
    atomic_safetensors_save,
    atomic_torch_save,
    find_checkpoint,
    load_checkpoint,
    load_weights,
)
from scaleup.config.plain import lookup
from scaleup.config.stored import stored_run
from scaleup.config.typed import export_config
from scaleup.errors import UserError
from scaleup.modules import submodule

log = logging.getLogger("scaleup")


def config_at(model_cfg: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The model config's entry at `path` when it builds that submodule (has a `_target_`), else None."""
    node = lookup(model_cfg, path)
    return node if isinstance(node, dict) and "_target_" in node else None


def export(cfg: DictConfig) -> Path:
    """Rebuild the LightningModule from the checkpoint's config, load every weight strictly, and save the state_dict
    of `model.<config.module>` alone: keys without the module's prefix, loadable into the bare network; a safetensors
    file where output_path ends in .safetensors."""
    config = export_config(cfg)
    output = Path(config.output_path)
    if output.is_dir():
        raise UserError(f"output_path={output} is a directory: name the file to write, e.g. {output / 'net.pt'}")
    if output.exists() and not config.overwrite:
        raise UserError(f"{output} already exists; choose another output_path or pass overwrite=true")
    ckpt_path = find_checkpoint(config.ckpt_path, prefer="best")
    checkpoint = load_checkpoint(ckpt_path)
    stored = stored_run(checkpoint, ckpt_path)
    model_cfg = stored.model
    model = build_model(model_cfg, precision=stored.plan.precision)  # float64 weights stay float64
    load_weights(model, checkpoint["state_dict"])  # every key fits, or the error names those that do not
    net = submodule(model, config.module)
    safetensors = output.suffix == ".safetensors"
    (atomic_safetensors_save if safetensors else atomic_torch_save)(net.state_dict(), output)
    net_cfg = config_at(model_cfg, config.module)
    owner = f"{type(net).__module__}.{type(net).__qualname__}"
    build = (
        f"hydra.utils.instantiate(cfg)  # cfg:\n{OmegaConf.to_yaml(net_cfg)}"
        if net_cfg
        else f"{owner}(...)  # as your LightningModule builds .{config.module}\n"
    )
    log.info(
        f"wrote {output} ({len(net.state_dict())} tensors of .{config.module}). Load it with:\n"
        f"  net = {build}"
        f"  net.load_state_dict({read_back(output, safetensors)})"
    )
    return output


def read_back(output: Path, safetensors: bool) -> str:
    """The expression that reads the exported file back as a state_dict."""
    if safetensors:
        return f"safetensors.torch.load_file('{output}')"
    return f"torch.load('{output}', weights_only=True)"
