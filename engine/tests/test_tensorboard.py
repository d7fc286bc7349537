"""What a default run shows in TensorBoard, read back from its event files: the plan and the final metrics in the
HParams tab, the planned peak LR in hparams.yaml, and the test-time images."""

import io

import pytest
import yaml
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from conftest import read_json

pytestmark = pytest.mark.slow  # shares the default training run of the end-to-end tests


@pytest.fixture(scope="module")
def events(trained_run):
    accumulator = EventAccumulator(str(trained_run / "tensorboard"), size_guidance={"images": 0})
    accumulator.Reload()
    return accumulator


def hparams_plugin_data(events) -> dict[str, plugin_data_pb2.HParamsPluginData]:
    return {
        tag.split("/")[-1]: plugin_data_pb2.HParamsPluginData.FromString(content)
        for tag, content in events.PluginTagToContent("hparams").items()
    }


def test_hparams_tab_holds_the_plan_and_the_final_metrics(trained_run, events):
    data = hparams_plugin_data(events)
    assert {"experiment", "session_start_info", "session_end_info"} <= data.keys()
    hparams = data["session_start_info"].session_start_info.hparams
    plan = read_json(trained_run / "plan.json")
    numbers = {
        "world_size",
        "per_device_batch_size",
        "global_batch_size",
        "accumulate_grad_batches",
        "lr",
        "warmup_steps",
        "total_steps",
        "dataset_sizes/train",
    }
    for name in numbers:
        expected = plan["dataset_sizes"]["train"] if name == "dataset_sizes/train" else plan[name]
        assert hparams[name].number_value == pytest.approx(expected), name
    assert hparams["precision"].string_value == plan["precision"] == "32-true"  # auto on CPU
    assert hparams["strategy"].string_value == plan["strategy"]
    assert hparams["sync_batchnorm"].bool_value is False

    # Every final metric is a column; the tab takes its value from the scalar logged under that name.
    columns = {info.name.tag for info in data["experiment"].experiment.metric_infos}
    metrics = read_json(trained_run / "metrics.json")
    assert columns == metrics.keys() and {"test/acc", "val/acc", "perf/samples_per_s"} <= columns
    assert events.Scalars("test/acc")[-1].value == pytest.approx(metrics["test/acc"])


def test_hparams_yaml_shows_the_planned_peak_lr(trained_run):
    saved = yaml.safe_load((trained_run / "tensorboard" / "hparams.yaml").read_text())
    plan = read_json(trained_run / "plan.json")
    assert saved["plan"]["lr"] == plan["lr"] and saved["plan"]["global_batch_size"] == 64
    assert saved["optimizer"]["lr"] == plan["base_lr"]  # the module's own hyperparameters stay beside it


def test_test_time_images(trained_run, events):
    assert "test/confusion_matrix" in events.Tags()["images"]
    plan = read_json(trained_run / "plan.json")
    matrix = events.Images("test/confusion_matrix")[-1]
    assert matrix.step == plan["total_steps"]
    picture = Image.open(io.BytesIO(matrix.encoded_image_string))
    assert picture.mode == "RGB" and min(picture.size) >= 400
    # The matrix is drawn in shades of blue: the diagonal of a 99% accurate model is dark, the rest near white.
    assert len(picture.getcolors(2**16)) > 10
    misclassified = round((1 - read_json(trained_run / "metrics.json")["test/acc"]) * 360)
    if misclassified == 0:  # a perfect test score has nothing to show
        assert "test/misclassified" not in events.Tags()["images"]
        return
    wrong = Image.open(io.BytesIO(events.Images("test/misclassified")[-1].encoded_image_string))
    assert wrong.width == 150 * min(misclassified, 8)  # one 1.5-inch tile per sample, 8 per row
