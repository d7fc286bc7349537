"""The second task, a character-level language model (experiment=char_lm), passes the classifier's tests: 1 vs 2
processes vs accumulation end with the same weights in float64, metrics are exact on uneven shards, the best
checkpoint follows its own monitor, and eval.py and export.py work on it unchanged."""

import math

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import QUICK, assert_same_weights, check, in_process, read_json, run, weights
from myproject.data.text import bundled_text
from scaleup.build import build_model
from scaleup.checkpoints.io import load_checkpoint

pytestmark = pytest.mark.slow

# The text is scikit-learn's data set descriptions, whose length varies with its version (672 blocks of 64
# characters with scikit-learn 1.9, 669 with 1.4.2): val 65 -> 33/32 blocks on 2 ranks (a batch short on one), test
# 63 -> 32/31. The rest (544 or 541 training blocks) make 8 global batches of 64 per epoch: 2 full epochs, 16 steps.
# A tiny transformer (LayerNorm, no dropout) has no batch statistics and no per-rank randomness: the split of a
# global batch over devices cannot change the result.
VAL, TEST, STEPS = 65, 63, 16
LM = [
    *QUICK,
    "experiment=char_lm",
    "trainer.precision=64-true",
    f"data.val_size={VAL}",
    f"data.test_size={TEST}",
    "model.net.width=32",
    "model.net.depth=1",
    "model.net.heads=2",
    "trainer.log_every_n_steps=1",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("char_lm")
    in_process([*LM, f"hydra.run.dir={root / 'one'}"])
    in_process([*LM, "trainer.accumulate_grad_batches=2", f"hydra.run.dir={root / 'accum'}"])
    check(run([*LM, "trainer.devices=2", "trainer.accelerator=cpu", f"hydra.run.dir={root / 'two'}"]))
    return root


@pytest.mark.parametrize("other", ["two", "accum"])
def test_one_process_equals_two_processes_and_accumulation_in_float64(runs, other):
    one, two = weights(runs / "one/checkpoints/last.ckpt"), weights(runs / f"{other}/checkpoints/last.ckpt")
    assert load_checkpoint(runs / f"{other}/checkpoints/last.ckpt")["global_step"] == STEPS
    assert one["net.head.weight"].dtype == torch.float64
    worst = assert_same_weights(one, two, rtol=0, atol=1e-10)
    print(f"char_lm, 1 process vs {other}: largest weight difference {worst:.1e} after {STEPS} steps")


def test_exact_metrics_on_uneven_shards(runs):
    one = read_json(runs / "one/metrics.json")
    train = (len(bundled_text()) - 1) // 64 - VAL - TEST  # the blocks left after val and test
    assert train // 64 == STEPS // 2
    assert read_json(runs / "two/plan.json")["dataset_sizes"] == {"train": train, "val": VAL, "test": TEST}
    for name in ("two", "accum"):
        other = read_json(runs / name / "metrics.json")
        assert (other["val/samples"], other["test/samples"]) == (VAL, TEST)  # no padding, no block twice
        for stage in ("val", "test"):
            assert other[f"{stage}/acc"] == one[f"{stage}/acc"]  # correct and total counts, all-gathered
            # The loss sums are float32 torchmetrics states, added up in another order on 2 ranks.
            assert math.isclose(other[f"{stage}/loss"], one[f"{stage}/loss"], rel_tol=1e-6)


def test_best_checkpoint_follows_the_configured_monitor(runs):
    """experiment=char_lm sets monitor.metric=val/loss, monitor.mode=min: the best checkpoint is the lowest."""
    events = EventAccumulator(str(runs / "one/tensorboard"))
    events.Reload()
    val_loss = [e.value for e in events.Scalars("val/loss")]
    assert len(val_loss) == 2 and val_loss[1] < val_loss[0]
    (best,) = (runs / "one/checkpoints").glob("best-*.ckpt")
    assert best.name == f"best-epoch001-{val_loss[1]:.4f}.ckpt"
    assert "tested the best checkpoint by val/loss" in (runs / "one/train.log").read_text()


def test_eval_and_export_work_on_the_language_model(runs, tmp_path):
    (best,) = (runs / "one/checkpoints").glob("best-*.ckpt")
    evaluated = in_process(
        [f"ckpt_path={best}", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}"], job="eval"
    )
    trained = read_json(runs / "one/metrics.json")
    for name in ("test/acc", "test/loss", "test/samples"):
        assert evaluated[name] == trained[name], name

    out = tmp_path / "net.pt"
    in_process([f"ckpt_path={best}", f"output_path={out}"], job="export")  # module=net, the default
    cfg = OmegaConf.load(runs / "one/config.yaml")
    net = instantiate(cfg.model.net).double()
    net.load_state_dict(torch.load(out, weights_only=True), strict=True)
    module = build_model(OmegaConf.to_container(cfg.model), precision="64-true")
    module.load_state_dict(load_checkpoint(best)["state_dict"])
    ids = torch.randint(cfg.model.net.vocab_size, (4, 64))
    torch.testing.assert_close(net.eval()(ids), module.eval()(ids), rtol=0, atol=0)
