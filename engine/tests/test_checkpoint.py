"""Safe loading, prefix repair and atomic writes, on real files."""

import os
import pathlib
import warnings

import pytest
import torch

from conftest import kill_writer_at_random
from scaleup.build import build_model
from scaleup.checkpoints.io import (
    atomic_safetensors_save,
    atomic_torch_save,
    find_checkpoint,
    load_checkpoint,
    load_weights,
    remove_interrupted_writes,
    strip_wrapper_prefixes,
)
from scaleup.errors import UserError
from testbed.models import DigitsCNN


class Payload:
    """Unpickling this calls Path.touch(marker): a stand-in for code a crafted checkpoint would run."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def test_malicious_pickle_is_refused_and_not_run(tmp_path):
    marker = tmp_path / "payload-ran"
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "extra": Payload(marker)}, path)
    with pytest.raises(UserError, match=r"refused to load .* could run arbitrary code"):
        load_checkpoint(path)
    assert not marker.exists()


def test_missing_truncated_and_foreign_files(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.ckpt")
    good = tmp_path / "good.ckpt"
    torch.save({"state_dict": DigitsCNN().state_dict()}, good)
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(UserError, match="truncated or corrupt"):
        load_checkpoint(truncated)
    text = tmp_path / "notes.ckpt"
    text.write_text("not a checkpoint\n")
    with pytest.raises(UserError, match="is not a PyTorch checkpoint"):
        load_checkpoint(text)
    tensor = tmp_path / "tensor.pt"
    torch.save(torch.ones(3), tensor)
    with pytest.raises(UserError, match="holds a Tensor"):
        load_checkpoint(tensor)


def test_foreign_state_dict_with_ddp_and_compile_prefixes_loads():
    source = DigitsCNN(norm="group")
    foreign = {f"module._orig_mod.{k}": v for k, v in source.state_dict().items()}
    assert set(strip_wrapper_prefixes(foreign)) == set(source.state_dict())
    target = DigitsCNN(norm="group")
    load_weights(target, foreign)
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value)


@pytest.mark.slow  # an end-to-end run
def test_compiled_module_keys_are_plain():
    """nn.Module.compile() (what model.compile=true uses) keeps parameter names; torch.compile() would not."""
    net = DigitsCNN()
    net.compile()
    assert list(net.state_dict()) == list(DigitsCNN().state_dict())
    assert next(iter(torch.compile(DigitsCNN()).state_dict())).startswith("_orig_mod.")


@pytest.mark.parametrize("precision", ["64-true", "64", "double"])
def test_float64_weights_load_unrounded_for_64_true(precision):
    """train.py (resume) and eval.py build the module for the run's precision before loading weights into it:
    for float64 it is built in float64, so the weights arrive bit for bit. A float32 module would round them
    (Lightning casts the module to float64 only after loading the checkpoint)."""
    model_cfg = {
        "_target_": "testbed.models.ImageClassifier",
        "net": {"_target_": "testbed.models.DigitsCNN", "num_classes": 10, "norm": "group"},
        "optimizer": {"_target_": "torch.optim.SGD", "lr": 0.1},
    }
    weights = {k: v.double() + 1e-12 for k, v in build_model(model_cfg).state_dict().items()}  # not float32-exact
    model = build_model(model_cfg, precision=precision)
    load_weights(model, weights)
    assert all(torch.equal(model.state_dict()[key], value) for key, value in weights.items())
    assert next(build_model(model_cfg).parameters()).dtype == torch.float32  # 32-true stays float32


def test_mismatched_weights_name_the_keys():
    with pytest.raises(UserError, match=r"missing keys: .*running_mean.*unexpected keys: none"):
        load_weights(DigitsCNN(norm="batch"), DigitsCNN(norm="group").state_dict())


def test_atomic_save_replaces_whole_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "ckpt" / "last.ckpt"
    atomic_torch_save({"step": 1}, path)
    atomic_torch_save({"step": 2}, path)
    assert load_checkpoint(path) == {"step": 2}
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # permissions like torch.save's, not mkstemp's 0600


def test_a_safetensors_file_of_tied_weights_loads_each_name(tmp_path):
    """An embedding tied to the output layer (one tensor under two names), a transposed view: the safetensors format
    takes neither as it is; each name is written as its own tensor, and the file is whole, with no temporary left."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    shared = torch.randn(5, 3)
    state = {"embed.weight": shared, "head.weight": shared, "proj.weight": torch.randn(3, 4).t()}
    path = tmp_path / "net.safetensors"
    atomic_safetensors_save(state, path)
    loaded = load_file(path)
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], v) for k, v in state.items())
    assert safe_open(str(path), framework="pt").metadata() == {"format": "pt"}
    assert [p.name for p in tmp_path.iterdir()] == ["net.safetensors"]


def write_forever(path: pathlib.Path, saved_once) -> None:
    """Saves 4 MB checkpoints to `path` in a loop, numbered, until killed."""
    torch.set_num_threads(1)  # a forked child: no OpenMP thread pool (as DataLoader workers do)
    version = 0
    while True:
        version += 1
        atomic_torch_save({"version": version, "weights": torch.full((1_000_000,), float(version))}, path)
        saved_once.set()


@pytest.mark.slow
def test_kill_9_during_writes_leaves_old_or_new_file(tmp_path):
    """A writer process that does nothing but save 4 MB checkpoints, killed (SIGKILL) at random moments, 10 times:
    each kill lands in a stream of saves (one every few ms) and must leave the previous or the next file whole.
    The writer is forked from this process, so it starts without importing torch again."""
    path = tmp_path / "last.ckpt"
    for trial in kill_writer_at_random(write_forever, path, max_delay=0.2):
        checkpoint = load_checkpoint(path)
        assert bool((checkpoint["weights"] == checkpoint["version"]).all()), trial
    stale = remove_interrupted_writes(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    print(f"10 kills: last.ckpt always complete; {len(stale)} interrupted temp files removed")


def test_a_directory_a_glob_or_best_finds_the_checkpoint(tmp_path):
    """ckpt_path may name the run, its checkpoints/ folder, <run>/best or <run>/last, or a glob (Hydra hands
    `key=value` over unexpanded, so `best-*.ckpt` reaches the job as typed)."""
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    best, last = folder / "best-epoch003-0.9500.ckpt", folder / "last.ckpt"
    best.touch(), last.touch()
    run = tmp_path / "run"
    for given in (run, folder, run / "best", f"{folder}/best-*.ckpt"):
        assert find_checkpoint(given, prefer="best") == best, given
    assert find_checkpoint(run, prefer="last") == find_checkpoint(run / "last") == last
    assert find_checkpoint(last) == last and find_checkpoint("memory://b/last.ckpt") == "memory://b/last.ckpt"
    with pytest.raises(UserError, match=r"best-\*\.ckpt matches 2 files"):
        (folder / "best-epoch004-0.9600.ckpt").touch()
        find_checkpoint(run)
    with pytest.raises(UserError, match=r"ckpt_path=.*/nothing-\*\.ckpt matches no file"):
        find_checkpoint(f"{folder}/nothing-*.ckpt")
    with pytest.raises(UserError, match=r"is a directory without last.ckpt in"):
        find_checkpoint(tmp_path, prefer="last")


def write_sharded(path: pathlib.Path, net: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A sharded checkpoint laid out as FSDP writes one (checkpoints/sharded.py), here by one process: the weights and
    the optimizer state, keyed by parameter name by torch's state_dict API, through torch.distributed.checkpoint;
    Lightning's loop state in meta.pt."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    shards = {"state_dict": get_model_state_dict(net), "optimizer_0": get_optimizer_state_dict(net, optimizer)}
    dcp.save(shards, checkpoint_id=path, no_dist=True)
    torch.save({"global_step": 1}, path / "meta.pt")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process writes every shard
@pytest.mark.parametrize(
    ("kind", "settings", "stateful"),
    [(torch.optim.SGD, {}, False), (torch.optim.SGD, {"momentum": 0.9}, True), (torch.optim.AdamW, {}, True)],
    ids=["SGD without momentum", "SGD with momentum", "AdamW"],
)
def test_a_sharded_optimizer_state_reads_as_one_process_holds_it(kind, settings, stateful, tmp_path):
    """Read on one process, a sharded checkpoint's optimizer state is the optimizer's own `state_dict()` (keyed by
    index over its two param groups), also where it is empty: SGD without momentum stores no `state` entry, and
    eval and export called such a checkpoint "not a PyTorch checkpoint" (a KeyError taken for an unreadable file)."""
    net = DigitsCNN()
    weights = [p for name, p in net.named_parameters() if name.endswith("weight")]
    others = [p for name, p in net.named_parameters() if not name.endswith("weight")]
    optimizer = kind([{"params": weights}, {"params": others, "weight_decay": 0.0}], lr=0.1, **settings)
    net(torch.randn(4, 1, 8, 8)).sum().backward()
    optimizer.step()
    write_sharded(tmp_path / "last.ckpt", net, optimizer)
    loaded = load_checkpoint(tmp_path / "last.ckpt")
    assert loaded["global_step"] == 1 and len(loaded["optimizer_states"]) == 1
    assert all(torch.equal(loaded["state_dict"][name], value) for name, value in net.state_dict().items())
    stored, expected = loaded["optimizer_states"][0], optimizer.state_dict()
    assert stored["param_groups"] == expected["param_groups"]
    assert (
        list(stored["state"])
        == list(expected["state"])
        == (list(range(len(weights) + len(others))) if stateful else [])
    )
    for index, state in expected["state"].items():
        assert all(torch.equal(stored["state"][index][name], value) for name, value in state.items()), index


def test_a_sharded_checkpoint_reads_on_one_process_without_torchs_warning(tmp_path):
    """eval, export and a resume read a sharded checkpoint on one process without a process group, on purpose
    (`no_dist=True`): torch's warning that it assumes so is not shown. Before: eval and export of an FSDP run's
    checkpoint printed `torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in
    a single process`."""
    net = DigitsCNN()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # one process writes every shard
        write_sharded(tmp_path / "last.ckpt", net, torch.optim.SGD(net.parameters(), lr=0.1))
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        loaded = load_checkpoint(tmp_path / "last.ckpt")
    assert all(torch.equal(loaded["state_dict"][name], value) for name, value in net.state_dict().items())
    assert [str(warning.message) for warning in shown] == []


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process writes every shard
def test_a_sharded_checkpoint_overwritten_with_garbage_is_one_line(tmp_path):
    """A shard file of the right size holding other bytes (a disk or a copy that garbled it) is refused in one line
    naming the checkpoint, the file and where, before torch.distributed.checkpoint reads it (its traceback: `Weights
    only load failed ... Unsupported operand`). The entry points and a resume on 2 processes: test_fsdp.py."""
    net = DigitsCNN()
    write_sharded(tmp_path / "last.ckpt", net, torch.optim.SGD(net.parameters(), lr=0.1))
    shard = tmp_path / "last.ckpt" / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))
    with pytest.raises(UserError) as refused:
        load_checkpoint(tmp_path / "last.ckpt")
    assert str(refused.value) == (
        f"sharded checkpoint {tmp_path / 'last.ckpt'} is corrupt: __0_0.distcp has no torch.save data at byte 0, "
        "where an entry starts; copy the whole directory again, or pass another checkpoint"
    )
