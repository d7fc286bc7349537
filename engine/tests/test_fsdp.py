"""strategy=fsdp (FSDP2) on 2 CPU processes (gloo), in float64: the same weights as DDP on 1, sharded checkpoints
that resume on another device count and evaluate and export on one CPU, atomic under kill -9.

Four multi-process training runs in all. The EXACT recipe on 2 FSDP processes (micro-batches of 32, the cap does not
bite), its model built on the meta device, is compared with the shared 1-process baseline (conftest
`baseline("one")`, accumulation 2), and its sharded checkpoint at step 13 resumes on 1 process. The WIDE recipe
(micro-batches of 16) resumes the 1-process WIDE reference's ordinary checkpoint at step 3 (conftest
`wide_reference`) on 2 torchrun nodes x 2 processes with hybrid sharding; its sharded checkpoint at step 4 resumes on
2 FSDP processes accumulating 6 micro-batches (one gradient reduction per step). All end with the references'
weights. The fourth, one short epoch of SGD without momentum (no optimizer state), evaluates and exports.
"""

import json
import math
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from test_launchers import assert_one_clean_run, free_port

from conftest import (
    EXACT,
    EXACT_EPOCHS,
    EXACT_STEPS_PER_EPOCH,
    EXACT_TEST,
    QUICK,
    TESTS,
    TOLERANCE,
    WIDE,
    assert_same_weights,
    check,
    engine_option,
    engine_section,
    files_written,
    in_process,
    kill_writer_at_random,
    merged,
    read_json,
    run,
    save_every,
    start,
)
from scaleup.checkpoints.io import load_checkpoint, remove_interrupted_writes
from scaleup.checkpoints.sharded import save_sharded
from scaleup.distributed.fsdp import Sharding, bytes_per_rank, unit_names
from scaleup.distributed.launch import build_strategy
from scaleup.errors import UserError, as_user_error
from scaleup.plan.resolve import Plan
from testbed.models import ImageClassifier

pytestmark = pytest.mark.slow

STEPS = EXACT_EPOCHS * EXACT_STEPS_PER_EPOCH
FSDP_RUN = [*EXACT, "trainer.devices=2", "strategy=fsdp", "checkpoint.every_n_train_steps=5"]
LAST_SAVED_AT = (5, 8, 10, 15, 16, 20, 24)  # every 5th step and every epoch's end (8 steps each)
# SGD without momentum: an optimizer that keeps no state
STATELESS_FSDP = ["trainer.devices=2", "strategy=fsdp", "model.optimizer.momentum=0", "model.optimizer.nesterov=false"]


def state(run_dir, name="checkpoints/last.ckpt"):
    return load_checkpoint(run_dir / name)["state_dict"]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """The EXACT recipe, `strategy=fsdp trainer.devices=2`, with a sharded checkpoint at step 13 (mid-epoch 1), and
    last.ckpt also every 5 steps. Its checkpoints are written in the background (`checkpoint.async_save=auto`): the
    tests that compare, resume and evaluate them prove that each holds the state of its step."""
    run_dir = tmp_path_factory.mktemp("fsdp") / "run"
    check(run([*FSDP_RUN, *save_every("at13", 13), f"hydra.run.dir={run_dir}"]))
    return run_dir


def test_two_fsdp_processes_equal_one_ddp_process(baseline, fsdp_run):
    """Weights, optimizer moments and the LRs of both param groups (the schedule's factor on each group's own LR,
    applied to DTensor shards) to TOLERANCE; accuracy and sample counts exactly; losses as float32 sums allow."""
    one = load_checkpoint(baseline("one") / "checkpoints/last.ckpt")
    sharded = load_checkpoint(fsdp_run / "checkpoints/last.ckpt")
    assert sharded["global_step"] == one["global_step"] == STEPS
    worst = assert_same_weights(one["state_dict"], sharded["state_dict"], rtol=0, atol=TOLERANCE)
    moments = [{i: s["exp_avg_sq"] for i, s in c["optimizer_states"][0]["state"].items()} for c in (one, sharded)]
    assert_same_weights(*moments, rtol=0, atol=TOLERANCE)
    lrs = [[group["lr"] for group in opt["optimizer_states"][0]["param_groups"]] for opt in (one, sharded)]
    assert lrs[0] == pytest.approx(lrs[1], rel=1e-12)
    metrics, reference = read_json(fsdp_run / "metrics.json"), read_json(baseline("one") / "metrics.json")
    for stage in ("val", "test"):
        assert (metrics[f"{stage}/acc"], metrics[f"{stage}/samples"]) == (
            reference[f"{stage}/acc"],
            reference[f"{stage}/samples"],
        )
        assert math.isclose(metrics[f"{stage}/loss"], reference[f"{stage}/loss"], rel_tol=1e-12)
    assert metrics["test/samples"] == EXACT_TEST
    print(f"2 FSDP processes vs 1 DDP process: largest weight difference {worst:.1e} after {STEPS} steps (float64)")


def test_every_rank_writes_its_shards_into_one_directory(fsdp_run):
    """A sharded checkpoint is a directory: Lightning's meta.pt, the metadata and one shard file per rank; no full
    state on rank 0, no temporary directory left; the plan names the units and the bytes per rank."""
    last = fsdp_run / "checkpoints/last.ckpt"
    assert sorted(p.name for p in last.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    meta = torch.load(last / "meta.pt", weights_only=True)
    assert "state_dict" not in meta and "optimizer_states" not in meta
    assert not list((fsdp_run / "checkpoints").glob(".*"))
    plan = read_json(fsdp_run / "plan.json")
    sharding = plan["sharding"]
    assert plan["strategy"] == "fsdp" and sharding["units"][:3] == ["net.0", "net.1", "net.3"]
    assert (len(sharding["units"]), sharding["mesh"], sharding["built_on_meta"]) == (7, [2], True)
    log = (fsdp_run / "train.log").read_text()
    assert "cannot be made shard by shard" not in log  # no tensor fell back to the ordinary build
    assert "parameters 0.36 MiB per rank of 0.72 MiB" in log
    # Measured on every rank's tensors after the first step: half the parameters, gradients alike, AdamW's two
    # moments twice that.
    measured = re.search(r"parameters ([\d.]+) MiB, gradients ([\d.]+) MiB, optimizer state ([\d.]+) MiB", log)
    params, grads, moments = map(float, measured.groups())
    assert params == grads == 0.36 and moments == pytest.approx(0.72, abs=0.01)
    saved = [Path(p) for p in re.findall(r"saved (\S+) in the background: training waited", log)]
    assert saved.count(fsdp_run / "steps/at-13.ckpt") == 1
    assert saved.count(fsdp_run / "checkpoints/last.ckpt") == len(LAST_SAVED_AT)


def test_sharded_checkpoint_resumes_on_one_device_with_ckpt_path_last(baseline, fsdp_run, tmp_path):
    """2 -> 1: the step-13 shards, as this run's last.ckpt, resumed by one process (accumulation 2)."""
    shutil.copytree(fsdp_run / "steps/at-13.ckpt", tmp_path / "checkpoints/last.ckpt")
    in_process([*EXACT, "trainer.devices=1", "strategy=fsdp", "ckpt_path=last", f"hydra.run.dir={tmp_path}"])
    log = (tmp_path / "train.log").read_text()
    assert "world_size 2 -> 1" in log and "accumulate_grad_batches 1 -> 2" in log
    assert load_checkpoint(tmp_path / "checkpoints/last.ckpt")["global_step"] == STEPS
    worst = assert_same_weights(state(baseline("one")), state(tmp_path), rtol=0, atol=TOLERANCE)
    print(f"FSDP on 2 processes, resumed on 1: largest weight difference {worst:.1e}")


def test_a_requeued_finished_run_trains_and_writes_nothing(fsdp_run, tmp_path):
    """The 2-process run's sharded last.ckpt is the end of training (step 24, though also written every 5 steps);
    requeued with ckpt_path=last (here on one process), the run says that it already finished, and no file changes."""
    requeued = shutil.copytree(fsdp_run, tmp_path / "run")
    before = files_written(requeued)
    metrics = in_process([*FSDP_RUN, "trainer.devices=1", "ckpt_path=last", f"hydra.run.dir={requeued}"])
    assert metrics == read_json(requeued / "metrics.json") and metrics["test/samples"] == EXACT_TEST
    assert files_written(requeued) == before
    assert (
        f"the run already finished: {requeued}/checkpoints/last.ckpt is at its last step ({STEPS})"
        in (requeued / "train.log").read_text()
    )


def test_sharded_checkpoint_evaluates_and_exports_on_one_cpu(fsdp_run, tmp_path, recwarn):
    best = next((fsdp_run / "checkpoints").glob("best-*.ckpt"))
    metrics = in_process(
        [f"ckpt_path={best}", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}"], job="eval"
    )
    trained = read_json(fsdp_run / "metrics.json")
    assert metrics["test/samples"] == EXACT_TEST and metrics["test/acc"] == trained["test/acc"]
    output = tmp_path / "net.pt"
    in_process([f"ckpt_path={fsdp_run}", f"output_path={output}", f"hydra.run.dir={tmp_path}"], job="export")
    exported = torch.load(output, weights_only=True)
    net = instantiate(OmegaConf.load(fsdp_run / "config.yaml").model.net)
    net.load_state_dict(exported)  # strict: no wrapper prefix, nothing missing
    trained_net = {
        key.removeprefix("net."): value for key, value in state(fsdp_run, best.relative_to(fsdp_run)).items()
    }
    assert_same_weights(exported, trained_net, rtol=0, atol=0)
    # read on one process on purpose: not torch's warning that it assumes so (observability/quiet.py)
    assert [str(w.message) for w in recwarn if "torch.distributed is disabled" in str(w.message)] == []


def test_a_sharded_checkpoint_of_an_optimizer_without_state_evaluates_and_exports(tmp_path):
    """SGD without momentum keeps no state: its sharded checkpoint holds no optimizer `state` entry. Eval and export
    read it on one CPU (they called it "not a PyTorch checkpoint (it may be truncated ...)", which a user may delete)
    with the run's test accuracy and its weights; the one-process reading has the empty state and both param groups.
    (Each optimizer kind, with and without state: test_checkpoint.py::test_a_sharded_optimizer_state_reads_...)"""
    run_dir = tmp_path / "run"
    check(run([*QUICK, "trainer.max_epochs=1", *STATELESS_FSDP, f"hydra.run.dir={run_dir}"]))
    last = load_checkpoint(run_dir / "checkpoints/last.ckpt")
    assert (run_dir / "checkpoints/last.ckpt/__1_0.distcp").is_file()  # sharded
    assert last["optimizer_states"][0]["state"] == {}
    assert [len(group["params"]) for group in last["optimizer_states"][0]["param_groups"]] == [4, 7]
    metrics = in_process([f"ckpt_path={run_dir}", f"hydra.run.dir={tmp_path / 'eval'}"], job="eval")
    assert metrics["test/acc"] == read_json(run_dir / "metrics.json")["test/acc"]
    output = tmp_path / "net.pt"
    in_process(
        [f"ckpt_path={run_dir}/checkpoints/last.ckpt", f"output_path={output}", f"hydra.run.dir={tmp_path}"],
        job="export",
    )
    trained = {key.removeprefix("net."): value for key, value in last["state_dict"].items()}
    assert_same_weights(torch.load(output, weights_only=True), trained, rtol=0, atol=0)


def test_a_sharded_checkpoint_with_a_file_lost_cut_or_overwritten_is_one_line(fsdp_run, tmp_path):
    """Copies of the step-13 shards, one without rank 1's file, one with rank 0's cut short, one with rank 1's
    overwritten by as many bytes of garbage: eval, export and a resume on 2 FSDP processes stop in one line naming the
    checkpoint and the file, before any process group (torch failed inside the load, in a traceback on every rank)."""
    missing, cut, garbage = tmp_path / "missing.ckpt", tmp_path / "cut.ckpt", tmp_path / "garbage.ckpt"
    for copy in (missing, cut, garbage):
        shutil.copytree(fsdp_run / "steps/at-13.ckpt", copy)
    (missing / "__1_0.distcp").unlink()
    size = (cut / "__0_0.distcp").stat().st_size
    with open(cut / "__0_0.distcp", "r+b") as f:
        f.truncate(size // 2)
    rank_1 = garbage / "__1_0.distcp"
    rank_1.write_bytes((bytes(range(256)) * rank_1.stat().st_size)[: rank_1.stat().st_size])
    expected = {
        missing: f"sharded checkpoint {missing} is incomplete: __1_0.distcp is missing; copy the whole directory again",
        cut: f"sharded checkpoint {cut} is incomplete: __0_0.distcp is truncated ({size // 2} of {size} bytes)",
        garbage: f"sharded checkpoint {garbage} is corrupt: __1_0.distcp has no torch.save data at byte 0, where an "
        "entry starts; copy the whole directory again",
    }
    jobs = {
        "eval": [],
        "export": [f"output_path={tmp_path / 'net.pt'}"],
        "train": [*EXACT, "strategy=fsdp", "trainer.devices=2"],
    }
    for path, message in expected.items():
        for job, args in jobs.items():
            with pytest.raises(Exception) as raised:
                in_process([*args, f"ckpt_path={path}", f"hydra.run.dir={tmp_path / job}"], job=job)
            assert str(as_user_error(raised.value)).startswith(message), (job, raised.value)
    assert not (tmp_path / "net.pt").exists() and not (tmp_path / "train/plan.json").exists()


@pytest.fixture(scope="module")
def hybrid_run(wide_reference, tmp_path_factory):
    """The WIDE recipe on 2 nodes x 2 processes, one torchrun per node on 127.0.0.1, with hybrid sharding (each node
    one copy of the model, sharded over its 2 processes), resumed from the 1-process reference's ordinary checkpoint
    at step 3 (mid-epoch 1); a sharded checkpoint at step 4."""
    run_dir, port = tmp_path_factory.mktemp("hybrid") / "run", free_port()
    args = [
        *WIDE,
        "strategy=fsdp",
        "strategy.sharding=hybrid",
        "trainer.devices=2",
        "trainer.num_nodes=2",
        f"ckpt_path={wide_reference / 'steps/at-3.ckpt'}",
        *save_every("at4", 4),
        "+callbacks.probe._target_=probes.RankProbe",
        f"+callbacks.probe.out_dir={run_dir / 'probe'}",
        f"hydra.run.dir={run_dir}",
    ]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2"]
    torchrun += ["--master_addr=127.0.0.1", f"--master_port={port}"]
    nodes = [start([*torchrun, f"--node_rank={node}", "train.py", *merged(args)]) for node in (0, 1)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    return run_dir


def test_hybrid_sharding_on_two_torchrun_nodes_equals_one_process(wide_reference, hybrid_run):
    """One run directory, ranks 0-3 on the right nodes, the (nodes, processes) mesh in the plan, and the float64
    weights of 1 process (dropout and augmentation on, micro-batches of 16 on both)."""
    ranks = assert_one_clean_run(hybrid_run, world_size=4, test_samples=EXACT_TEST)
    assert [(r["rank"], r["local_rank"], r["node_rank"]) for r in ranks] == [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
    plan = read_json(hybrid_run / "plan.json")
    assert (plan["num_nodes"], plan["per_device_batch_size"], plan["accumulate_grad_batches"]) == (2, 16, 3)
    assert plan["sharding"]["mesh"] == [2, 2]  # sharded within a node, replicated across the 2 nodes
    assert "world_size 1 -> 4" in (hybrid_run / "train.log").read_text()
    worst = assert_same_weights(state(wide_reference), state(hybrid_run), rtol=0, atol=TOLERANCE)
    print(f"1 process, resumed on 2 nodes x 2 processes with hybrid sharding: largest weight difference {worst:.1e}")


def test_a_hybrid_checkpoint_resumes_on_one_node_and_evaluates_on_one_device(wide_reference, hybrid_run, tmp_path):
    """2 nodes x 2 -> 1 node x 2: the step-4 shards, resumed by 2 FSDP processes accumulating 6 micro-batches of 16
    per step, gradients reduced once per step, each unit's activations recomputed in the backward (the same dropout
    masks drawn again), end with the reference's weights under their plain names; the final hybrid checkpoint
    evaluates on one CPU with the reference's test numbers."""
    args = [*WIDE, "trainer.devices=2", "strategy=fsdp", "strategy.activation_checkpointing=true"]
    args.append(f"ckpt_path={hybrid_run / 'steps/at-4.ckpt'}")
    check(run([*args, f"hydra.run.dir={tmp_path / 'resumed'}"]))
    plan = read_json(tmp_path / "resumed/plan.json")
    assert (plan["accumulate_grad_batches"], plan["world_size"]) == (6, 2)
    assert plan["sharding"]["gradient_sync"] == "step"  # gradients reduced once per optimizer step
    assert "world_size 4 -> 2" in (tmp_path / "resumed/train.log").read_text()
    worst = assert_same_weights(state(wide_reference), state(tmp_path / "resumed"), rtol=0, atol=TOLERANCE)
    hybrid, reference = (
        in_process([f"ckpt_path={run_dir / 'checkpoints/last.ckpt'}", f"hydra.run.dir={tmp_path / name}"], job="eval")
        for name, run_dir in (("hybrid", hybrid_run), ("reference", wide_reference))
    )
    assert (hybrid["test/samples"], hybrid["test/acc"]) == (EXACT_TEST, reference["test/acc"])
    print(f"hybrid shards resumed on 1 node x 2 processes: largest weight difference {worst:.1e}")


def test_a_model_larger_than_a_ranks_memory_limit_is_built_sharded_with_the_ordinary_weights(tmp_path):
    """tests/fsdp_meta.py: 2 processes under a hard data-memory limit of 0.75x the model's parameters, which refuses
    the ordinary build, build it on the meta device and shard it; every shard equals its slice of the ordinary
    build, and a training step runs."""
    result = check(run([str(tmp_path)], script=str(TESTS / "fsdp_meta.py")))
    ranks = json.loads((tmp_path / "meta.json").read_text())
    assert [(r["recorded"], r["eager_refused"], r["worst"]) for r in ranks] == [(True, True, 0.0)] * 2
    assert ranks[0]["limit_mib"] < ranks[0]["parameters_mib"] and math.isfinite(ranks[0]["loss"])
    print(result.stdout.strip()[-300:])


def test_clipping_recomputation_and_accumulation_keep_the_gradients_of_the_whole_model(tmp_path):
    """tests/fsdp_gradients.py; with accumulation over 3 micro-batches, the gradients leave the rank once: a third
    of the reduce-scatters (sync_gradients=step), or of the all-reduces across nodes (hybrid, micro_batch)."""
    result = check(run([str(tmp_path)], script=str(TESTS / "fsdp_gradients.py")))
    sync = json.loads((tmp_path / "sync.json").read_text())
    for name in ("step", "micro_batch"):
        every, once = sync[name]["collectives"]
        assert every == 3 * once > 0 and sync[name]["worst"] < 1e-12, (name, sync[name])
    print(result.stdout.strip())


def write_forever(path, saved_once):
    """Save sharded checkpoints of version 0, 1, 2, ... as fast as possible (a real torch.distributed.checkpoint
    write on one process): weights and meta.pt both hold the version."""
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)  # forked: the parent's OpenMP pool is not usable here

    def write(version):
        def into(tmp):
            dcp.save({"state_dict": {"w": torch.full((64, 64), float(version))}}, checkpoint_id=tmp, no_dist=True)
            torch.save({"version": version}, tmp / "meta.pt")

        return into

    for version in range(10**6):
        save_sharded(path, write(version), is_global_zero=True, barrier=lambda: None)
        saved_once.set()


def write_forever_in_background(path, saved_once):
    """The same saves written in the background (checkpoint.async_save), on a one-process group: each one's weights
    are overwritten as soon as it returns, as training goes on while a checkpoint is written."""
    import torch.distributed as dist

    from scaleup.checkpoints.background import BackgroundSaver

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    saver, weights = BackgroundSaver(), torch.zeros(64, 64)
    for version in range(10**6):
        weights.fill_(version)
        saver.save({"state_dict": {"w": weights}}, {"version": version}, path, is_global_zero=True)
        weights.fill_(-1.0)
        if version == 0:
            saver.wait()
            saved_once.set()


@pytest.mark.parametrize("writer", [write_forever, write_forever_in_background], ids=["sync", "async"])
def test_kill_9_during_sharded_saves_leaves_a_whole_checkpoint(tmp_path, writer):
    """A writer that does nothing but save sharded checkpoints, killed (SIGKILL) at random moments, 10 times: the
    shards being written (in the background, for async), or the swap of the directories: the old or the new
    checkpoint is there, whole, and holds the weights of the step it was taken at."""
    path = tmp_path / "last.ckpt"
    for trial in kill_writer_at_random(writer, path, max_delay=0.1):
        checkpoint = load_checkpoint(path)
        assert bool((checkpoint["state_dict"]["w"] == checkpoint["version"]).all()), trial
    remove_interrupted_writes(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


@pytest.mark.parametrize(
    ("strategy", "devices", "setting", "in_background"),
    [("fsdp", 2, "auto", True), ("fsdp", 2, False, False), ("fsdp", 1, "auto", False), ("ddp", 2, "auto", False)],
)
def test_async_save_is_on_where_checkpoints_are_sharded(strategy, devices, setting, in_background):
    """`checkpoint.async_save=auto`: sharded checkpoints (strategy=fsdp on 2+ processes) are written in the
    background; one process, and DDP, keep ModelCheckpoint's one-file save."""
    built, _ = build_strategy(
        engine_section(f"strategy/{strategy}"), world_size=devices, multirun=False, async_save=setting
    )
    assert getattr(built, "async_save", False) is in_background


def test_a_strategy_group_named_fsdp_without_its_target_is_one_line():
    """strategy=fsdp's YAML names its Lightning strategy (`_target_`); a group of the user's own that leaves it out
    is told to start from the engine's option, not that fsdp is an unknown name."""
    from scaleup.config.schema import Strategy
    from scaleup.config.typed import section

    option = {key: value for key, value in engine_option("strategy/fsdp").items() if key != "_target_"}
    with pytest.raises(UserError, match=r"strategy.name=fsdp: this strategy group names no Lightning strategy"):
        build_strategy(section(Strategy, option), world_size=2, multirun=False)


def test_default_units_are_the_blocks_of_every_network_and_classes_select_others():
    net = {"_target_": "testbed.models.resnet", "name": "resnet18", "num_classes": 10}
    resnet = ImageClassifier(net=net, optimizer={"_target_": "torch.optim.SGD"})
    units = unit_names(resnet, None)
    assert units[:3] == ["net.conv1", "net.bn1", "net.layer1.0"] and units[-1] == "net.fc" and len(units) == 11
    assert unit_names(resnet, ["torchvision.models.resnet.BasicBlock"]) == [
        f"net.layer{i}.{j}" for i in range(1, 5) for j in range(2)
    ]
    total, per_rank = bytes_per_rank(resnet, 8)
    assert total / 8 <= per_rank < total / 8 * 1.01  # dim 0 padded to a multiple of 8


def test_a_dry_run_plans_the_shards_anywhere(tmp_path):
    """ResNet-50 on 4 nodes of 8 GPUs with hybrid sharding, planned on a laptop: the units, the (4, 8) mesh, and 1/8
    of the parameters per rank."""
    args = ["strategy=fsdp", "model=resnet50", "data=synthetic", "trainer.devices=8", "trainer.num_nodes=4"]
    plan = in_process([*args, "strategy.sharding=hybrid", "dry_run=true", f"hydra.run.dir={tmp_path}"])
    assert plan["strategy"] == read_json(tmp_path / "plan.json")["strategy"] == "fsdp"
    sharding = Sharding(**plan["sharding"])
    units = sharding.units
    assert len(units) == 19 and units[:4] == ("net.conv1", "net.bn1", "net.layer1.0", "net.layer1.1")
    # float32 x 23,528,522 parameters; a rank holds 1/8 of each tensor's rows, padded to a multiple of 8
    assert (sharding.parameter_bytes_per_rank, sharding.parameter_bytes) == (11_770_408, 4 * 23_528_522)
    assert (sharding.mesh, sharding.built_on_meta) == ((4, 8), True)
    assert (plan["sync_batchnorm"], plan["sync_batchnorm_rule"]) == (False, "fsdp")
    row = dict(sharding.rows(Plan.from_dict(plan)))["sharding"]
    assert row.startswith("19 unit(s) (net.conv1, net.bn1, net.layer1.0, net.layer1.1") and (
        "parameters 11.23 MiB per rank of 89.75 MiB" in row
    )


GPU_OPTIONS = {
    "bf16 parameters, fp32 reduction": ["strategy.mixed_precision=bfloat16", "trainer.precision=32-true"],
    "cpu offload": ["strategy.cpu_offload=true", "strategy.activation_checkpointing=true"],
}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("options", GPU_OPTIONS.values(), ids=GPU_OPTIONS.keys())
def test_fsdp_on_two_gpus_trains_and_its_shards_evaluate_on_a_cpu(options, tmp_path):
    """NCCL, ResNet-18 sharded at its BasicBlocks, with FSDP's GPU options: it learns, the checkpoint holds float32
    master weights under plain names, and a CPU evaluates it with the training run's numbers."""
    data = [
        "data=synthetic",
        "data.train_size=512",
        "data.val_size=64",
        "data.test_size=64",
        "data.global_batch_size=64",
    ]
    model = ["model=resnet18", "model.net.small_input=true", "trainer.max_epochs=2", "logger=none"]
    fsdp = ["strategy=fsdp", "trainer.devices=2", "strategy.shard_modules=[torchvision.models.resnet.BasicBlock]"]
    quiet = ["trainer.enable_progress_bar=false", "trainer.num_sanity_val_steps=0"]
    check(run([*data, *model, *fsdp, *options, *quiet, f"hydra.run.dir={tmp_path / 'train'}"]))
    last = tmp_path / "train" / "checkpoints" / "last.ckpt"
    assert (last / ".metadata").is_file()
    weights = load_checkpoint(last)["state_dict"]
    assert {v.dtype for v in weights.values() if v.is_floating_point()} == {torch.float32}
    assert weights["net.fc.weight"].shape == (10, 512) and not any("_fsdp" in key for key in weights)
    best = next((tmp_path / "train" / "checkpoints").glob("best-*.ckpt"))
    args = [f"ckpt_path={best}", "trainer.accelerator=cpu", f"hydra.run.dir={tmp_path / 'eval'}"]
    check(run(args, script="eval.py"))
    trained, evaluated = read_json(tmp_path / "train/metrics.json"), read_json(tmp_path / "eval/metrics.json")
    assert evaluated["test/samples"] == 64 and math.isclose(evaluated["test/acc"], trained["test/acc"], abs_tol=0.05)
