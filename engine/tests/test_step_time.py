"""Where the step time goes across ranks: the per-rank breakdown, the straggler named, the run's advice, and the
speedup estimate a dry run makes from a previous run (scaleup.observability.step_time, .speedup)."""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from conftest import check, in_process, made_once, read_json, run
from scaleup.data.adopted import AdoptedDataModule
from scaleup.observability.speedup import Measured, Target, differences, estimate, estimate_lines, measured_run
from scaleup.observability.step_time import (
    LoaderWorkers,
    RankTimes,
    find_straggler,
    loader_workers,
    rank_metrics,
    ranks_from_metrics,
    summary_lines,
)
from testbed.data import DigitsDataModule
from testbed.models import ImageClassifier


class SlowRank(ImageClassifier):
    """The classifier, sleeping `delays[rank]` seconds in every training step after its forward: ranks that compute
    at different speeds (a straggler), with the same work otherwise."""

    def __init__(self, delays: list[float], **kwargs) -> None:
        super().__init__(**kwargs)
        self.delays = list(delays)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        time.sleep(self.delays[self.global_rank])
        return loss


# Rank 1 sleeps 3x as long as rank 0 in every step, on top of the same compute: 10 steps of 16 digits per rank.
STRAGGLER = [
    "trainer.devices=2",
    "trainer.accelerator=cpu",
    "model._target_=test_step_time.SlowRank",
    "+model.delays=[0.05,0.15]",
    "model.net.width=8",
    "data.global_batch_size=32",
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=10",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
    "trainer.enable_progress_bar=false",
    "trainer.num_sanity_val_steps=0",
]


@pytest.fixture(scope="module")
def straggler_run(tmp_path_factory) -> Path:
    """One 2-process run whose rank 1 is a straggler, shared by the tests below."""
    return made_once(
        tmp_path_factory, "straggler", lambda run_dir: check(run([*STRAGGLER, f"hydra.run.dir={run_dir}"]))
    )


@pytest.mark.slow  # 2 processes
def test_a_rank_three_times_slower_is_named_with_its_share(straggler_run):
    """The warning at the epoch's end names rank 1 and its host, its compute against rank 0's, and the share of rank
    0's step spent waiting for it in the all-reduce (about 100 ms of a 150-170 ms step); the summary ends with the
    step-time breakdown of rank 1 (the rank the others wait for) and the straggler again."""
    metrics = read_json(straggler_run / "metrics.json")
    compute = [metrics[f"perf/rank{r}/compute_s"] for r in (0, 1)]
    comm = [metrics[f"perf/rank{r}/comm_s"] for r in (0, 1)]
    step0 = compute[0] + comm[0] + metrics["perf/rank0/data_wait_s"]
    assert 1.5 < compute[1] / compute[0] < 3.5 and metrics["perf/straggler_ratio"] == pytest.approx(
        compute[1] / compute[0]
    )
    waiting = (comm[0] - comm[1]) / step0
    # rank 0 waits for rank 1's extra 100 ms (about 60% of its step on an idle machine; less where a busy machine
    # slows the compute); rank 1 waits for the transfer alone
    assert 0.25 < waiting < 0.8
    log = (straggler_run / "train.log").read_text()
    [warning] = [line for line in log.splitlines() if "is a straggler" in line and "WARNING" in line]
    assert (
        f"rank 1 (host {socket.gethostname()}) is a straggler: it computes a training batch in {1000 * compute[1]:.1f} "
        f"ms, {compute[1] / compute[0]:.1f}x the other ranks' median ({1000 * compute[0]:.1f} ms), and the others "
        f"spend {waiting:.0%} of their step waiting for it in the gradient all-reduce" in warning
    )
    step1 = compute[1] + comm[1] + metrics["perf/rank1/data_wait_s"]
    shares = [compute[1] / step1, metrics["perf/rank1/data_wait_s"] / step1, comm[1] / step1]
    *_, breakdown, advice = log.splitlines()
    assert breakdown.endswith(
        f"step time: {1000 * step1:.1f} ms per training batch (rank 1, which the others wait for): compute "
        f"{shares[0]:.0%}, data wait {shares[1]:.0%}, communication {shares[2]:.0%}"
    )
    assert "rank 1 (node 0; its host is named in the warning above) is a straggler" in advice


@pytest.mark.slow  # the 2-process baseline, shared with test_ddp
def test_a_healthy_two_process_run_has_the_per_rank_breakdown(baseline):
    """Each rank's compute, data wait and exposed communication per batch add up to its step time, which the
    throughput measures on its own: per-device batch x 2 ranks / samples per second."""
    run_dir = baseline("two")
    metrics, plan = read_json(run_dir / "metrics.json"), read_json(run_dir / "plan.json")
    step = plan["per_device_batch_size"] * 2 / metrics["perf/samples_per_s"]
    for rank in (0, 1):
        parts = [metrics[f"perf/rank{rank}/{name}"] for name in ("compute_s", "data_wait_s", "comm_s")]
        assert all(part >= 0 for part in parts) and parts[0] > 0
        assert sum(parts) / step == pytest.approx(1, abs=0.1)
    assert 0 <= metrics["perf/comm_share"] < 1 and metrics["perf/straggler_ratio"] >= 1


@pytest.mark.slow  # reads the straggler run
def test_a_dry_run_estimates_the_speedup_from_a_previous_run(straggler_run, tmp_path, caplog):
    """`dry_run=true trainer.devices=4 diagnostics_from=<run>`: the measured figures and the model's step time on 4
    devices (the global batch of 32 in 8 per device), as `estimate` computes them."""
    with caplog.at_level(logging.INFO, logger="scaleup"):
        in_process(
            ["dry_run=true", "trainer.devices=4", "trainer.accelerator=cpu", "data.global_batch_size=32",
             "model.net.width=8", f"diagnostics_from={straggler_run}", f"hydra.run.dir={tmp_path}"]
        )  # fmt: skip
    lines = [r.getMessage() for r in caplog.records]
    measured = measured_run(str(straggler_run))
    result = estimate(measured, Target(4, 1, 8, 1))
    [head] = [line for line in lines if line.startswith("speedup estimate from")]
    assert head.startswith(
        f"speedup estimate from {straggler_run}: 2 device(s) on 1 node(s), per-device batch 16 x 1 accumulation, "
        f"measured {1000 * measured.step:.1f} ms per optimizer step"
    )
    [target] = [line for line in lines if line.startswith("  on 4 device(s)")]
    assert f"(per-device batch 8 x 1 accumulation, global 32): about {1000 * result.step:.1f} ms" in target
    assert f"{result.over_measured:.2f}x the measured run" in target
    assert any(line.startswith("  the measured run had a straggler (rank 1): the estimate assumes") for line in lines)
    # The healthy rank's rate, not the mean of rank 0's and the straggler's.
    assert measured.compute == read_json(straggler_run / "metrics.json")["perf/rank0/compute_s"]
    assert any(line.startswith("  measured per training batch (median of the ranks but 1): compute") for line in lines)
    # The measured run's module was SlowRank, this one's the plain classifier: said first, loudly.
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "is not this" in r.message]
    parameters = read_json(straggler_run / "plan.json")["parameters"]
    assert warning.startswith(
        f"the measured run ({straggler_run}) is not this run: model SlowRank(DigitsCNN), {parameters:,} parameters "
        f"-> ImageClassifier(DigitsCNN), {parameters:,} parameters. The estimate scales its step times"
    )
    assert any(line.startswith("  assumes: compute and data wait per sample as measured") for line in lines)


def test_the_speedup_model_on_known_figures():
    """2 devices measured: 12 ms of compute and data wait per batch of 32 (0.375 ms a sample) and 4 ms exposed
    all-reduce. On 4 devices with the same global batch of 64: 16 samples a device (6 ms), the ring's traffic
    2(4-1)/4 = 1.5 against 2(2-1)/2 = 1 (6 ms): 12 ms a step, 64 / 12 ms = 5,333 samples/s, 1.33x the measured
    16 ms, 2x one device doing the 64 samples in 24 ms (efficiency 50%)."""
    measured = Measured(2, 1, 32, 1, compute=0.010, data_wait=0.002, comm=0.004, step=0.016)
    result = estimate(measured, Target(4, 1, 16, 1))
    assert (result.work, result.comm, result.step) == pytest.approx((0.006, 0.006, 0.012))
    assert (result.samples_per_s, result.over_measured, result.over_one) == pytest.approx((64 / 0.012, 4 / 3, 2))
    assert result.efficiency(4) == pytest.approx(0.5)
    # One device: no communication; 8 devices, 8 per device: 3 ms of work, 4 ms x 1.75 of all-reduce, slower.
    assert estimate(measured, Target(1, 1, 64, 1)).step == pytest.approx(0.024)
    assert estimate(measured, Target(8, 1, 8, 1)).step == pytest.approx(0.003 + 0.007)
    # One device would be slower than the measured two: keep them (not "fewer devices").
    slower = [line for line in estimate_lines(measured, Target(1, 1, 64, 1), "run") if "slower" in line]
    assert slower == ["  1 device(s) would be slower than the measured run: keep its 2 device(s)"]
    # From one device nothing is known of the all-reduce: left out, the step is a lower bound.
    alone = estimate(Measured(1, 1, 32, 1, 0.010, 0.002, 0.0, 0.012), Target(4, 1, 16, 1))
    assert alone.comm is None and alone.step == pytest.approx(0.006)


def test_a_measured_run_with_a_straggler_is_estimated_at_the_healthy_ranks_rate_and_its_differences_named(tmp_path):
    """2 ranks, rank 1 a straggler (62.5 ms against 11.1 ms): the estimate's compute is rank 0's, not their mean
    (36.8 ms). A CPU float32 digits run asked for resnet18 on synthetic data on GPUs in bf16: each difference
    named, measured -> planned; the same run: none."""
    from omegaconf import OmegaConf

    ranks = [RankTimes(0.001, 0.0111, 0.0525), RankTimes(0.001, 0.0625, 0.001)]
    plan = {"world_size": 2, "num_nodes": 1, "per_device_batch_size": 16, "accumulate_grad_batches": 1}
    plan |= {"parameters": 94186, "precision": "32-true", "accelerator": "cpu"}
    config = {
        "model": {"_target_": "m.ImageClassifier", "net": {"_target_": "m.DigitsCNN"}},
        "data": {"_target_": "d.Digits"},
    }
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    (tmp_path / "metrics.json").write_text(json.dumps(rank_metrics(ranks)))
    OmegaConf.save(OmegaConf.create(config), tmp_path / "config.yaml")
    measured = measured_run(str(tmp_path))
    assert (measured.straggler, measured.compute) == (1, 0.0111)
    assert differences(str(tmp_path), plan, config) == []
    other = {
        "model": {"_target_": "m.ImageClassifier", "net": {"_target_": "m.ResNet18"}},
        "data": {"_target_": "d.Synthetic"},
    }
    planned = plan | {"parameters": 11181642, "precision": "bf16-mixed", "accelerator": "gpu", "world_size": 4}
    assert differences(str(tmp_path), planned, other) == [
        "model ImageClassifier(DigitsCNN), 94,186 parameters -> ImageClassifier(ResNet18), 11,181,642 parameters",
        "data Digits -> Synthetic",
        "precision 32-true -> bf16-mixed",
        "accelerator cpu -> gpu",
    ]


def test_the_straggler_and_the_advice_from_per_rank_figures():
    """Rank 1 computes 40 ms against rank 0's 10: ratio 4; rank 0 waits 30 ms in the all-reduce where rank 1, the
    last to arrive, waits 1 ms for the transfer alone: rank 0 spends 29 ms of its 41 ms step waiting for rank 1.
    The breakdown is rank 1's (the others' step is its): compute 95%, data wait 2%, communication 2%."""
    metrics = rank_metrics([RankTimes(0.001, 0.010, 0.030), RankTimes(0.001, 0.040, 0.001)])
    ranks = ranks_from_metrics(metrics)
    assert ranks == [RankTimes(0.001, 0.010, 0.030), RankTimes(0.001, 0.040, 0.001)]
    assert metrics["perf/straggler_ratio"] == pytest.approx(4) and metrics["perf/comm_share"] == pytest.approx(1 / 42)
    straggler = find_straggler(ranks)
    assert (straggler.rank, straggler.ratio, straggler.others_waiting) == (1, pytest.approx(4), pytest.approx(29 / 41))
    lines = summary_lines(metrics, workers=LoaderWorkers(0), in_memory=False, devices_per_node=2)
    assert lines[0] == (
        "step time: 42.0 ms per training batch (rank 1, which the others wait for): compute 95%, data wait 2%, "
        "communication 2%"
    )
    assert lines[1].startswith("rank 1 (node 0; its host is named in the warning above) is a straggler")
    # Loading 30% of the step with 3 workers needed, and 20% in the all-reduce: data-bound and communication-bound.
    bound = rank_metrics([RankTimes(0.003, 0.005, 0.002)] * 2) | {"perf/loader_workers_needed": 2.4}
    data, comm = summary_lines(bound, workers=LoaderWorkers(1), in_memory=False, devices_per_node=2)[1:]
    assert data == (
        "data-bound: 30% of the step waits for batches (above ~20%, fix the loading before adding devices): "
        "data.num_workers=3 (measured: 2.4 workers per device keep up; now 1)"
    )
    assert comm == (
        "communication-bound: 20% of the step waits for the gradient all-reduce (above ~10% scaling is far from "
        "linear): a larger per-device batch (data.per_device_batch_size, or trainer.accumulate_grad_batches), "
        "strategy.bucket_cap_mb, or fewer devices; the estimate for another device count: python train.py "
        "dry_run=true trainer.devices=M diagnostics_from=<this run>"
    )
    assert len(summary_lines(bound, workers=LoaderWorkers(1), in_memory=True, devices_per_node=2)) == 2  # no loader


class OwnLoaders(L.LightningDataModule):
    """A plain LightningDataModule that sets its loader's workers itself: its constructor takes no num_workers."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(range(8), batch_size=4, num_workers=2)


class WorkersArgument(OwnLoaders):
    """The same, its workers an argument (as lightning-hydra-template's MNISTDataModule takes them)."""

    def __init__(self, num_workers: int = 2) -> None:
        super().__init__()
        self.num_workers = num_workers


def adopted(module: L.LightningDataModule) -> AdoptedDataModule:
    datamodule = AdoptedDataModule(module)
    datamodule.build_splits()  # the module's own loaders, as the jobs read them before the Trainer exists
    return datamodule


def test_the_advice_names_only_settings_the_run_has():
    """The workers are advised where the run sets them: `data.num_workers` for the template's data modules and an
    adopted one that takes it, else the DataLoader of the module's own train_dataloader() (the template takes its
    workers: data/adopted.py), with the count it had; no gradient accumulation for a module with manual optimization,
    where Lightning refuses it. Before: data.num_workers always, with the config's count (4 by default beside a
    module that ignores it), and trainer.accumulate_grad_batches for a GAN."""
    assert loader_workers(DigitsDataModule(num_workers=3)) == LoaderWorkers(3, "data.num_workers={}")
    assert loader_workers(adopted(WorkersArgument())) == LoaderWorkers(2, "data.num_workers={}")
    own = loader_workers(adopted(OwnLoaders()))
    assert own == LoaderWorkers(2, "num_workers={} in the DataLoader OwnLoaders.train_dataloader() returns")
    bound = rank_metrics([RankTimes(0.003, 0.005, 0.002)] * 2) | {"perf/loader_workers_needed": 2.4}
    data, comm = summary_lines(bound, workers=own, in_memory=False, devices_per_node=2, manual_optimization=True)[1:]
    assert data == (
        "data-bound: 30% of the step waits for batches (above ~20%, fix the loading before adding devices): "
        "num_workers=3 in the DataLoader OwnLoaders.train_dataloader() returns (measured: 2.4 workers per device "
        "keep up; now 2)"
    )
    assert "a larger per-device batch (data.per_device_batch_size), strategy.bucket_cap_mb" in comm
