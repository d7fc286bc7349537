"""The contract between the jobs and a user's own code (docs/contract.md, scaleup.api), clause by clause."""

import hydra
import pytest
import torch
from omegaconf import OmegaConf
from torchmetrics import MeanSquaredError, MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassRecall

from conftest import QUICK, in_process, read_json
from scaleup.build import build_model
from scaleup.checkpoints.io import load_checkpoint
from scaleup.data.datamodule import apply_model_settings
from scaleup.errors import UserError
from scaleup.observability.metrics import StageMetrics

# A LightningModule that is not the template's classifier: its network is `self.encoder`, built from
# `model.encoder`, and it takes none of ImageClassifier's arguments.
ENCODER = [
    *QUICK,
    "trainer.max_epochs=1",
    "model._target_=user_modules.EncoderModule",
    "~model.net",
    "~model.label_smoothing",
    "~model.compile",
    "~model.figures",
    "+model.encoder._target_=testbed.models.DigitsCNN",
    "+model.encoder.num_classes=10",
    "+model.encoder.width=8",
]


def test_data_fills_only_the_null_settings_the_model_config_has():
    model = {"net": {"num_classes": None, "width": 8}, "head": {"num_classes": 3}}
    apply_model_settings(model, {"net.num_classes": 10, "head.num_classes": 10, "net.depth": 2, "decoder.vocab": 5})
    assert model == {"net": {"num_classes": 10, "width": 8}, "head": {"num_classes": 3}}


@pytest.mark.parametrize("datamodule", ["StreamingDataModule", "StreamLoaderDataModule"])
def test_an_iterable_dataset_is_refused_in_one_line_naming_the_sharded_data(tmp_path, datamodule):
    """A stream cannot be split into per-rank slices of global batches: each rank would read it whole. From the
    template's DataModule (build_splits) and from any LightningDataModule (its train_dataloader) alike."""
    with pytest.raises(UserError) as refused:
        in_process([f"data._target_=user_modules.{datamodule}", "trainer.max_steps=1", f"hydra.run.dir={tmp_path}"])
    assert str(refused.value) == (
        f"data: the train split of {datamodule} is an IterableDataset (StreamedDigits): the template splits "
        "each global batch between ranks by index, which a stream does not offer, so every rank would read all of "
        "it. Use map-style datasets (__getitem__ and __len__), or write the data as shards "
        "(`python -m scaleup.data.convert`, then data=sharded: docs/sharded-data.md)"
    )


def test_stage_metrics_wrap_any_metric_per_stage_and_add_loss_and_samples():
    metrics = StageMetrics(
        MetricCollection({"acc": MulticlassAccuracy(3, average="micro"), "recall": MulticlassRecall(3)})
    )
    logits = torch.tensor([[2.0, 0, 0], [0, 2.0, 0], [0, 2.0, 0], [0, 0, 2.0]])
    target = torch.tensor([0, 1, 2, 2])
    metrics.update("val", logits[:3], target[:3], batch_size=3, loss=torch.tensor(1.0))  # uneven batches
    metrics.update("val", logits[3:], target[3:], batch_size=1, loss=torch.tensor(3.0))
    values = {name: float(metric.compute()) for name, metric in metrics.items("val")}
    assert values == pytest.approx({"acc": 0.75, "recall": (1 + 1 + 0.5) / 3, "loss": 1.5, "samples": 4.0})
    assert [name for name, _ in metrics.items("train")] == ["acc", "recall", "samples"]  # no loss passed there yet
    assert [name for name, _ in StageMetrics(MeanSquaredError()).items("test")] == ["MeanSquaredError", "samples"]
    with pytest.raises(ValueError, match="rename your metric 'samples'"):
        StageMetrics({"samples": MeanSquaredError()})
    evaluation_only = StageMetrics({"acc": MulticlassAccuracy(3), "mse": MeanSquaredError()}, eval_only=["mse"])
    assert [name for name, _ in evaluation_only.items("train")] == ["acc", "samples"]
    assert [name for name, _ in evaluation_only.items("val")] == ["acc", "mse", "samples"]
    with pytest.raises(ValueError, match="eval_only names 'acc5', which is not one of the metrics: acc, mse"):
        StageMetrics({"acc": MulticlassAccuracy(3), "mse": MeanSquaredError()}, eval_only=["acc5"])


def test_monitor_mode_must_be_min_or_max(tmp_path):
    with pytest.raises(UserError, match=r"monitor\.mode=lowest must be one of min, max"):
        in_process([*QUICK, "monitor.mode=lowest", f"hydra.run.dir={tmp_path}"])


@pytest.fixture(scope="module")
def encoder_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("encoder")
    in_process([*ENCODER, f"hydra.run.dir={run_dir}"])
    return run_dir


@pytest.mark.slow
def test_any_lightning_module_trains_and_evaluates(encoder_run, tmp_path):
    trained = read_json(encoder_run / "metrics.json")
    assert (trained["val/samples"], trained["test/samples"]) == (180, 360) and "val/acc" in trained
    (best,) = (encoder_run / "checkpoints").glob("best-*.ckpt")
    evaluated = in_process([f"ckpt_path={best}", f"hydra.run.dir={tmp_path}"], job="eval")
    for name in ("test/acc", "test/loss", "test/samples"):
        assert evaluated[name] == trained[name], name


@pytest.mark.slow
def test_export_takes_the_network_the_module_setting_names(encoder_run, tmp_path):
    (best,) = (encoder_run / "checkpoints").glob("best-*.ckpt")
    with pytest.raises(UserError, match="EncoderModule has no submodule 'net'; its children are encoder, metrics"):
        in_process([f"ckpt_path={best}", f"output_path={tmp_path / 'net.pt'}"], job="export")  # module=net
    out = tmp_path / "encoder.pt"
    in_process([f"ckpt_path={best}", f"output_path={out}", "module=encoder"], job="export")
    cfg = OmegaConf.load(encoder_run / "config.yaml")
    encoder = hydra.utils.instantiate(cfg.model.encoder)
    encoder.load_state_dict(torch.load(out, weights_only=True), strict=True)
    module = build_model(OmegaConf.to_container(cfg.model))
    module.load_state_dict(load_checkpoint(best)["state_dict"])
    x = torch.randn(8, 1, 8, 8)
    torch.testing.assert_close(encoder.eval()(x), module.eval()(x), rtol=0, atol=0)


@pytest.mark.slow
def test_a_monitor_the_module_does_not_log_is_one_clear_message(tmp_path):
    with pytest.raises(UserError) as refused:
        in_process([*ENCODER, "monitor.metric=val/accuracy", f"hydra.run.dir={tmp_path}"])
    assert str(refused.value) == (
        "monitor.metric=val/accuracy is not logged by EncoderModule, which logs val/acc, val/loss, val/samples: set "
        "monitor.metric (and monitor.mode=min|max) to one of them, e.g. in your experiment config"
    )
