"""The export job behind `python export.py`: the bare network's weights as a plain state_dict."""

from __future__ import annotations

import logging
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from scaleup.engine.checkpoint import atomic_torch_save, load_checkpoint, load_weights
from scaleup.engine.errors import UserError
from scaleup.evaluate import stored_run

log = logging.getLogger("scaleup")

NET_PREFIX = "net."  # the LightningModule holds the network as `self.net`


def export(cfg: DictConfig) -> Path:
    output = Path(cfg.output_path)
    if output.exists() and not cfg.overwrite:
        raise UserError(f"{output} already exists; choose another output_path or pass overwrite=true")
    checkpoint = load_checkpoint(cfg.ckpt_path)
    net_cfg = stored_run(checkpoint, cfg.ckpt_path)["config"]["model"]["net"]
    weights = {k[len(NET_PREFIX) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(NET_PREFIX)}
    net = instantiate(net_cfg)
    load_weights(net, weights)  # proves the strict load works before anything is written
    atomic_torch_save(net.state_dict(), output)
    log.info(
        f"wrote {output} ({len(weights)} tensors). Load it with:\n"
        f"  net = hydra.utils.instantiate(cfg)  # cfg:\n{OmegaConf.to_yaml(net_cfg)}"
        f"  net.load_state_dict(torch.load('{output}', weights_only=True))"
    )
    return output
