"""The default job end to end: `python train.py` (the real entry point), then eval and export on what it wrote
(in this process, but for the 2-process evaluation)."""

import json
import re

import hydra
import pytest
import torch
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import check, in_process, printed, read_json, run, warmup_cosine
from scaleup.build import build_model
from scaleup.checkpoints.io import load_checkpoint
from scaleup.errors import UserError

pytestmark = pytest.mark.slow


def best_checkpoint(run_dir):
    (best,) = (run_dir / "checkpoints").glob("best-*.ckpt")
    return best


def test_default_run_reaches_target_and_writes_every_file(trained_run):
    metrics = read_json(trained_run / "metrics.json")
    assert metrics["test/acc"] >= 0.95
    assert metrics["val/samples"] == 180 and metrics["test/samples"] == 360
    assert {"train/loss", "train/acc", "val/loss", "val/acc", "val/acc5", "test/loss", "test/acc"} <= metrics.keys()
    assert 0 <= metrics["perf/data_wait"] < 1 and metrics["perf/samples_per_s"] > 0 and metrics["perf/peak_mem_gb"] > 0
    plan = read_json(trained_run / "plan.json")
    assert plan["dataset_sizes"] == {"train": 1257, "val": 180, "test": 360}
    assert (plan["world_size"], plan["global_batch_size"], plan["seed"]) == (1, 64, 42)
    assert {p.name for p in (trained_run / "checkpoints").iterdir()} == {"last.ckpt", best_checkpoint(trained_run).name}
    assert [p.name for p in trained_run.glob("*.log")] == ["train.log"]
    log = (trained_run / "train.log").read_text()
    assert "global batch" in log and "done:" in log
    assert OmegaConf.load(trained_run / "config.yaml").model.net.num_classes == 10
    last = load_checkpoint(trained_run / "checkpoints" / "last.ckpt")
    assert last["global_step"] == plan["total_steps"]  # the plan's step count is what the Trainer did


def test_tensorboard_events_hold_the_expected_tags(trained_run):
    events = EventAccumulator(str(trained_run / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss_step", "train/loss", "val/acc", "val/loss", "lr-SGD/decay", "test/acc"} <= tags


def test_at_the_base_batch_the_lr_decays_from_the_first_step_to_the_last(trained_run):
    """Global batch 64 = the base batch: the peak LR is the base LR, so there is no warmup, and the cosine spans all
    228 steps (a warmup from the base LR to the same peak held it flat through epoch 0, and a 1-epoch run at the
    default batch never decayed at all)."""
    plan = read_json(trained_run / "plan.json")
    assert (plan["lr_factor"], plan["warmup_steps"], plan["total_steps"]) == (1.0, 0, 228)
    events = EventAccumulator(str(trained_run / "tensorboard"))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("lr-SGD/decay")}
    assert min(logged) < 4 and max(logged) > 223  # logged every 4 steps, from the first to the last
    assert logged == pytest.approx({step: warmup_cosine(step, 0.1, 0.1, 0, 228) for step in logged}, rel=1e-6)


# What a default run printed that its user cannot act on, each now silenced where it starts
# (scaleup/observability/quiet.py, and the diagnostics for data held in memory).
NOISE = (
    "litlogger",  # Lightning's tip for its cloud logger, at every Trainer's start
    "LeafSpec",  # torch's deprecation of what Lightning's CombinedLoader builds, once per process
    "FLOPs",  # Lightning's summary counts none without an example_input_array and printed 0 everywhere
    "will override existing callbacks",  # the module's own callbacks, attached again for the test after fit
)


def test_a_default_run_prints_only_what_to_act_on(trained_run):
    """No line of NOISE and no warning: the default recipe on one CPU process has nothing to warn about (the data
    wait of an in-memory data set is an info line: test_diagnostics), and the plan says how many parameters."""
    lines = printed(trained_run).read_text().splitlines()
    assert [line for line in lines if any(noise in line for noise in NOISE)] == []
    assert [line for line in lines if "WARNING" in line or "Warning" in line] == []
    assert "  parameters            94,186" in lines  # the plan counts them: no layer table by default


def test_eval_reproduces_the_training_runs_test_numbers(trained_run, tmp_path):
    ckpt = best_checkpoint(trained_run)
    in_process([f"ckpt_path={ckpt}", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}"], job="eval")
    trained, evaluated = read_json(trained_run / "metrics.json"), read_json(tmp_path / "metrics.json")
    for name in ("test/acc", "test/acc5", "test/loss", "test/samples"):
        assert evaluated[name] == trained[name], name


def test_eval_on_two_processes_gives_the_same_numbers(trained_run, tmp_path):
    check(
        run(
            [
                f"ckpt_path={best_checkpoint(trained_run)}",
                "trainer.devices=2",
                "trainer.accelerator=cpu",
                "trainer.enable_progress_bar=false",
                f"hydra.run.dir={tmp_path}",
            ],
            script="eval.py",
        )
    )
    trained, evaluated = read_json(trained_run / "metrics.json"), read_json(tmp_path / "metrics.json")
    assert evaluated["test/samples"] == 360 and evaluated["test/acc"] == trained["test/acc"]
    assert evaluated["test/loss"] == pytest.approx(trained["test/loss"], rel=1e-5)


def test_export_round_trip_strict_load_same_predictions(trained_run, tmp_path):
    out = tmp_path / "net.pt"
    ckpt = best_checkpoint(trained_run)
    in_process([f"ckpt_path={ckpt}", f"output_path={out}"], job="export")
    cfg = OmegaConf.load(trained_run / "config.yaml")
    net = hydra.utils.instantiate(cfg.model.net)
    net.load_state_dict(torch.load(out, weights_only=True), strict=True)
    module = build_model(OmegaConf.to_container(cfg.model))
    module.load_state_dict(load_checkpoint(ckpt)["state_dict"])
    x = torch.randn(16, 1, 8, 8)
    torch.testing.assert_close(net.eval()(x), module.eval()(x), rtol=0, atol=0)

    with pytest.raises(UserError, match="already exists"):
        in_process([f"ckpt_path={ckpt}", f"output_path={out}"], job="export")


@pytest.mark.parametrize("job", ["eval", "export"])
def test_missing_checkpoint_is_one_clear_message(tmp_path, job):
    """The message only; test_errors checks that the entry points print it as one line with exit code 2."""
    args = [f"ckpt_path={tmp_path}/nope.ckpt", f"hydra.run.dir={tmp_path}"]
    with pytest.raises(UserError, match=f"^checkpoint {tmp_path}/nope.ckpt does not exist"):
        in_process(args + ([f"output_path={tmp_path}/x.pt"] if job == "export" else []), job=job)


def test_a_default_run_attaches_few_engine_callbacks_in_their_fixed_order(tmp_path):
    """At most 6 of the engine's callbacks on a default run (the default callbacks config included), all in
    scaleup.callbacks, in the order scaleup.trainer.template_callbacks states, the config's after them and the
    SIGTERM stop after those."""
    census = tmp_path / "callbacks.json"
    in_process(["trainer.max_steps=1", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}",
                f"+callbacks.census={{_target_:user_modules.CallbackCensus,path:'{census}'}}"])  # fmt: skip
    names = json.loads(census.read_text())
    # ClassificationFigures is the module's own choice (the example's configure_callbacks), not the engine's
    engine = [name for name in names if name.startswith("scaleup.") and not name.endswith(".ClassificationFigures")]
    assert len(engine) == 6, engine  # 5 of the machinery's, and the default callbacks config's diagnostics
    assert all(name.startswith("scaleup.callbacks.") for name in engine), engine  # one package holds them

    def at(name: str) -> list[int]:
        return [i for i, found in enumerate(names) if found.endswith(f".{name}")]

    user = min(at("LearningRateMonitor") + at("CallbackCensus"))
    assert max(at("StepPlan")) < user  # the LR set before it is logged; the seeded stream
    assert max(at("ExactEvalMetrics")) < min(at("ModelCheckpoint") + at("RunFiles"))  # exact before read
    # after every callback of the config (Lightning then appends the module's and moves the checkpoints last)
    assert at("JobControl") == [max(at("TrainingDiagnostics") + at("CallbackCensus")) + 1]


CRASHES = {
    "in training": (["+callbacks.fail={_target_:probes.FailOnRank,rank:0,step:3}"], "RuntimeError: injected failure"),
    "in the module's __init__": (["model._target_=user_modules.BuggyClassifier"], "TypeError: empty(): argument"),
}


@pytest.mark.parametrize("where", CRASHES)
def test_a_one_process_crash_leaves_its_traceback_in_train_log_and_failure_json(where, tmp_path):
    """As a failing rank of several processes does (test_rank_failures): the traceback in train.log and failure.json
    naming rank 0 and exit code 1, also for a bug in the user's __init__, before anything else is logged."""
    overrides, error = CRASHES[where]
    with pytest.raises(Exception, match=re.escape(error.split(": ", 1)[1])):
        in_process(["trainer.max_epochs=1", "trainer.enable_progress_bar=false", "logger=none", *overrides,
                    f"hydra.run.dir={tmp_path}"])  # fmt: skip
    record = read_json(tmp_path / "failure.json")
    assert record | {"message": ""} == {"what": "error", "ranks": [0], "exit_code": 1, "message": ""}
    assert record["message"].startswith("Traceback (most recent call last):") and error in record["message"]
    assert record["message"] in (tmp_path / "train.log").read_text()
