"""Sharded data: the converter, the shard-aware order on any topology and worker count, exact evaluation, faults,
a remote with a bounded cache, and float64 training on 1 and 2 processes with a resume across both counts."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch
from test_launchers import free_port
from torch.utils.data import Subset, TensorDataset

from conftest import (
    EXACT,
    EXACT_TEST,
    EXACT_TRAIN,
    EXACT_VAL,
    QUICK,
    ROOT,
    TOLERANCE,
    assert_same_weights,
    clean_env,
    in_process,
    merged,
    read_json,
    save_every,
    start,
    weights,
)
from scaleup.data.convert import main as convert
from scaleup.data.convert import raw_sample
from scaleup.data.image_batches import normalize
from scaleup.data.index import SPLITS
from scaleup.data.index import main as index_main
from scaleup.data.samplers import resumed_steps
from scaleup.data.sharded import ShardedDataModule
from scaleup.data.shards import remote
from scaleup.data.shards.cache import RESERVED, ShardCache
from scaleup.data.shards.index import ShardIndex, shard_list_checksum
from scaleup.data.shards.order import ShardWindowOrder
from scaleup.data.shards.prefetch import Prefetcher, Spool
from scaleup.data.shards.remote import filesystem
from scaleup.data.shards.samples import read_samples
from scaleup.errors import UserError, exit_on_user_error
from testbed.data import IMAGENET_MEAN, IMAGENET_STD

PER_SHARD = 64  # 513 training samples: 9 shards, the last holding one
SOURCE = ["data=digits", f"data.val_size={EXACT_VAL}", f"data.test_size={EXACT_TEST}", f"samples_per_shard={PER_SHARD}"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """The EXACT recipe's digits splits as shards, written by 2 worker processes."""
    out = tmp_path_factory.mktemp("shards") / "digits"
    assert convert([*SOURCE, f"out={out}", "workers=2"]) == 0
    return out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["out=s3://bucket/conv"], "error: out=s3://bucket/conv: the converter writes to a local directory; convert"),
        (["out={tmp}", "samples_per_shard=0"], "error: samples_per_shard=0 must be an integer >= 1"),
        (["out={tmp}", "samples_per_shard=abc"], "error: samples_per_shard=abc must be an integer >= 1"),
        (
            ["out={tmp}", "sample_per_shard=8"],
            "error: sample_per_shard: there is no such key; did you mean samples_per_shard?",
        ),
        (  # a key of the template's own sections: no `+KEY=VALUE` offered, it would be refused
            ["out={tmp}", "trainer.devics=2"],
            "error: trainer.devics is not a key of trainer; did you mean trainer.devices?",
        ),
        (["out=/dev/null/conv"], "error: out=/dev/null/conv: /dev/null is not a directory; choose another out=DIR"),
        (["out=/proc/conv"], "error: out=/proc/conv cannot be created ("),
        (
            ["out={tmp}", "data.augment=true"],
            "error: data.augment=true would store one random draw of each training sample in the shards, the same "
            "every epoch: convert with data.augment=false",
        ),
    ],
)
def test_converter_refuses_a_wrong_argument_in_one_line(args, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the project, whose configs the converter composes
    assert convert(["data=digits", *(arg.format(tmp=tmp_path / "out") for arg in args)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []  # nothing written, not even ./s3:


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (  # was a TypeError in a worker process, under multiprocessing's traceback
            ["data._target_=user_modules.DictDigitsDataModule"],
            "error: sample 0 of the train split: cannot store a dict in a shard (tensors, arrays, ints, text, "
            "images). A sample is stored as one such value or a tuple (input, target, ...) of them: return tuples "
            "from the datasets you convert",
        ),
        (  # was torch's RuntimeError
            ["data.val_size=-3"],
            "error: val_size=-3 must be >= 0: a count (>= 1), or a fraction (< 1) of 1797",
        ),
    ],
    ids=["dict samples", "negative val_size"],
)
def test_converter_refuses_data_it_cannot_store_or_a_wrong_value_in_one_line(shards, args, message, tmp_path, capsys):
    """Refused as train.py refuses it, before anything in `out` is touched: an earlier conversion there stays."""
    out = shutil.copytree(shards, tmp_path / "out")
    before = sorted(out.rglob("*"))
    capsys.readouterr()
    assert convert(["data=digits", f"out={out}", "workers=2", *args]) == 2
    err = capsys.readouterr().err
    assert err == f"{message}\n"
    assert sorted(out.rglob("*")) == before and len(ShardIndex.load(f"{out}/train")) == EXACT_TRAIN


def test_converting_again_replaces_the_earlier_conversion_whole(shards, tmp_path, capsys):
    """9 training shards of 64, converted again with 2000 a shard and no test split: one shard per split, no test/,
    the indexer counting the training split once; a folder holding anything else is refused, nothing removed."""
    out = shutil.copytree(shards, tmp_path / "out")
    (out / "train/.partial-shard-000003.tar").write_bytes(b"")  # a crashed conversion's leftover
    assert convert([*SOURCE, f"out={out}", "samples_per_shard=2000", "data.test_size=0", "workers=1"]) == 0
    assert f"{out}: the earlier conversion removed" in capsys.readouterr().out
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        "train",
        "train/index.json",
        "train/shard-000000.tar",
        "val",
        "val/index.json",
        "val/shard-000000.tar",
    ]
    assert index_main([str(out)]) == 0
    assert len(ShardIndex.load(f"{out}/train")) == 1797 - EXACT_VAL  # the digits without the validation split
    (out / "notes.txt").write_text("mine")
    assert convert([*SOURCE, f"out={out}", "workers=1"]) == 2
    assert capsys.readouterr().err == (
        f"error: out={out} holds {out / 'notes.txt'}, which the converter does not write: convert into a new or "
        "empty directory (an earlier conversion there is replaced whole)\n"
    )
    assert (out / "train/shard-000000.tar").is_file()


def test_converter_stores_samples_without_the_splits_transform():
    """A training split that augments in its `transform` (torchvision's convention: CIFAR-10's random crop and
    flip): the converter stores each image as it is, the same on every conversion, and leaves the transform in
    place."""
    from torchvision.transforms import v2

    from testbed.data import Transformed

    images = torch.arange(2 * 3 * 4 * 5).to(torch.uint8).reshape(2, 3, 4, 5)
    flip = v2.RandomHorizontalFlip(p=1.0)
    dataset = Transformed(TensorDataset(images, torch.tensor([3, 5])), flip)
    (image, image_bytes), (label, label_bytes) = raw_sample(Subset(dataset, [1]), 0)
    assert (image, label, label_bytes) == ("0.npy", "1.cls", b"5")
    assert np.array_equal(np.load(io.BytesIO(image_bytes)), images[1].numpy())
    assert dataset.transform is flip


def test_indexer_refuses_samples_twice_a_field_it_cannot_read_and_no_target(shards, tmp_path, capsys):
    """The converter's validation tars with a stale copy of a shard beside them (the same keys twice), then
    chosen fields that are unknown or leave no label: each one line, exit 2; the tars alone index."""
    split = shutil.copytree(shards / "val", tmp_path / "val")
    (split / "index.json").unlink()
    shutil.copy(split / "shard-000000.tar", split / "shard-000009.tar")
    errors = {
        (): f"sample '000000000000' is in both shard-000000.tar and shard-000009.tar of {split}: a split holds each "
        "sample once; remove the tars left there by another conversion or copy, then index again",
        ("fields=0.npy",): f"fields=0.npy gives the samples of {split / 'shard-000000.tar'} no target: training "
        "needs an input and its target (the label); e.g. fields=0.npy,1.cls",
        ("fields=0.json",): f"field '0.json' of {split / 'shard-000000.tar'} has a type the reader does not decode "
        "(cls, gif, jpeg, jpg, npy, png, txt, webp): choose the fields to train on, e.g. fields=jpg,cls",
    }
    capsys.readouterr()
    for args, message in errors.items():
        assert index_main([str(split), *args]) == 2
        assert capsys.readouterr().err == f"error: {message}\n"
    assert not (split / "index.json").exists()
    (split / "shard-000009.tar").unlink()
    assert index_main([str(split)]) == 0 and len(ShardIndex.load(str(split))) == EXACT_VAL


def test_converted_shards_indexed_again_keep_what_the_model_needs(shards, tmp_path, capsys):
    """The converter's tars indexed again, a split alone then the whole folder: `net.num_classes` is counted from the
    largest label (the converter's field `1.cls`: the indexer only read a field named `cls`, and dropped the class
    count, so training failed inside the net), and a setting the converter recorded that tars cannot give (here a
    vocabulary size) is kept. An index without the class count trains into one line naming the key."""
    out = shutil.copytree(shards, tmp_path / "out")
    converted = ShardIndex.load(f"{shards}/train").model_settings
    assert converted == {"net.in_channels": 1, "net.num_classes": 10}
    assert index_main([f"{out}/train"]) == 0
    assert ShardIndex.load(f"{out}/train").model_settings == converted
    doc = json.loads((out / "train/index.json").read_text())
    doc["scaleup"]["model_settings"] = {"net.vocab_size": 65}  # what the tars cannot give, and an older index's
    (out / "train/index.json").write_text(json.dumps(doc))
    (out / "val/index.json").unlink()
    assert index_main([str(out)]) == 0
    assert ShardIndex.load(f"{out}/train").model_settings == converted | {"net.vocab_size": 65}
    assert ShardIndex.load(f"{out}/val").model_settings == converted
    for split in SPLITS:  # indexes without the class count, as the indexer wrote them
        doc = json.loads((out / split / "index.json").read_text())
        doc["scaleup"]["model_settings"] = {"net.in_channels": 1}
        (out / split / "index.json").write_text(json.dumps(doc))
    with pytest.raises(UserError) as raised:
        in_process([*QUICK, "data=sharded", f"data.url={out}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert str(raised.value) == (
        "model.net.num_classes is null, to be taken from the data, and the data (scaleup.data.sharded."
        "ShardedDataModule) does not give it (it gives model.net.in_channels): set "
        "model.net.num_classes=<value>"
    )


def module(url, global_batch_size: int = 64, **kwargs) -> ShardedDataModule:
    settings = {"window_shards": 2, "persistent_workers": False, **kwargs}  # workers end with their loader
    return ShardedDataModule(url=str(url), global_batch_size=global_batch_size, seed=42, **settings)


def global_batches(dm: ShardedDataModule, world_size: int, epoch: int, accumulation: int = 1) -> list[torch.Tensor]:
    """Every step's global batch of images, reassembled from each rank's micro-batches in rank order."""
    loaders = [list(dm.rank_loader(world_size, r, epoch=epoch, accumulation=accumulation)) for r in range(world_size)]
    steps = len(loaders[0]) // accumulation
    return [
        torch.cat([x for r in range(world_size) for x, _ in loaders[r][k * accumulation : (k + 1) * accumulation]])
        for k in range(steps)
    ]


def test_converter_is_deterministic_parallel_and_stores_sizes_and_checksums(shards, tmp_path, capsys):
    assert convert([*SOURCE, f"out={tmp_path}", "workers=1"]) == 0
    assert "train: 9/9 shards written" in capsys.readouterr().out.splitlines()
    files = sorted(p.relative_to(shards) for p in shards.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert all((shards / f).read_bytes() == (tmp_path / f).read_bytes() for f in files)  # 1 or 2 workers alike
    doc = json.loads((shards / "train/index.json").read_text())
    assert [s["nsamples"] for s in doc["shardlist"]] == [64] * 8 + [1]
    assert doc["scaleup"]["samples"] == EXACT_TRAIN and doc["scaleup"]["fields"] == ["0.npy", "1.cls"]
    assert doc["scaleup"]["checksum"] == shard_list_checksum(doc["shardlist"])
    for entry in doc["shardlist"]:
        data = (shards / "train" / entry["url"]).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (entry["filesize"], entry["sha256"])
        assert np.array(entry["crc32"]).shape == (entry["nsamples"], 2)  # per sample, per member
    assert doc["scaleup"]["model_settings"] == {"net.num_classes": 10, "net.in_channels": 1}
    sizes = {split: len(ShardIndex.load(f"{shards}/{split}")) for split in ("train", "val", "test")}
    assert sizes == {"train": EXACT_TRAIN, "val": EXACT_VAL, "test": EXACT_TEST}


def test_shards_hold_the_source_samples(shards):
    from testbed.data import DigitsDataModule

    source = DigitsDataModule(val_size=EXACT_VAL, test_size=EXACT_TEST).build_splits()["test"]
    dm = module(shards)
    dm.setup()
    for i in (0, 577, EXACT_TEST - 1):
        image, label = dm.splits["test"][i]
        assert torch.equal(image, source[i][0]) and label == int(source[i][1])


def test_window_shuffle_permutes_shards_and_keeps_each_window_together():
    counts = np.array([5, 7, 3, 9, 4, 6, 1])
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    shard_of = np.repeat(np.arange(len(counts)), counts)
    orders = {}
    for epoch in (0, 1):
        order = ShardWindowOrder(counts, window=3, seed=42, epoch=epoch)
        values = order[np.arange(counts.sum())]
        assert sorted(values) == list(range(counts.sum()))  # a permutation of the split
        shards_seen = [list(dict.fromkeys(shard_of[values]))]
        ends = order.window_ends
        windows = [set(shard_of[values[a:b]]) for a, b in zip([0, *ends[:-1]], ends, strict=True)]
        assert [len(w) for w in windows] == [3, 3, 1] and set().union(*windows) == set(range(7))
        orders[epoch] = values
        assert shards_seen and np.array_equal(starts[shard_of[values]] <= values, np.ones(len(values), bool))
    assert not np.array_equal(orders[0], orders[1])


def test_global_batches_do_not_depend_on_devices_accumulation_or_workers(shards):
    """The same images in every global batch on 1 device, 2 devices with 2 loader workers each, 4 devices, and
    1 device accumulating 2; a new order the next epoch; every batch from one window (two at its edge)."""
    reference = global_batches(module(shards), 1, epoch=1)
    assert len(reference) == EXACT_TRAIN // 64
    for world, workers, accumulation in ((2, 2, 1), (4, 0, 1), (1, 0, 2)):
        batches = global_batches(module(shards, num_workers=workers), world, epoch=1, accumulation=accumulation)
        assert len(batches) == len(reference)
        assert all(torch.equal(a, b) for a, b in zip(reference, batches, strict=True)), (world, workers)
    other = global_batches(module(shards), 1, epoch=2)
    assert not torch.equal(torch.cat(reference), torch.cat(other))
    dm = module(shards)
    dm.setup()
    sampler = dm.train_sampler(64, 1, 0)
    sampler.set_epoch(1)
    ids = np.array(list(sampler))  # no transform: plain indices, no (epoch, index) keys for seeding
    assert len(set(ids)) == len(ids) == 8 * 64  # no sample twice
    shard = np.searchsorted(np.cumsum(dm.indexes["train"].counts), ids, side="right").reshape(8, 64)
    assert max(len(set(step)) for step in shard) <= 4  # one window of 2 shards, or the edge of two


def test_resumed_sampler_skips_exactly_the_steps_taken(shards):
    full = global_batches(module(shards), 1, epoch=1)
    dm = module(shards, num_workers=2)
    dm.setup()
    sampler = dm.train_sampler(64, 2, 1)
    sampler.set_epoch(1)
    sampler.resume(1, 5)
    loader = dm._loader("train", sampler, 32)
    assert all(torch.equal(x, full[5 + k][32:]) for k, (x, _) in enumerate(loader))
    assert len(list(loader)) == 3


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_evaluation_counts_every_sample_once_in_contiguous_runs(shards, world):
    dm = module(shards)
    dm.setup()
    shares = [list(dm.eval_sampler("test", world, r)) for r in range(world)]
    assert [i for share in shares for i in share] == list(range(EXACT_TEST))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def as_older_index(directory: Path) -> None:
    """Rewrite every index under `directory` as a converter before per-member checksums and spans wrote it."""
    for path in directory.rglob("index.json"):
        doc = json.loads(path.read_text())
        for shard in doc["shardlist"]:
            del shard["crc32"], shard["spans"]
        doc["scaleup"]["checksum"] = shard_list_checksum(doc["shardlist"])
        path.write_text(json.dumps(doc))


def test_a_flipped_corrupt_or_truncated_shard_is_one_error_naming_it(shards, tmp_path):
    copy = shutil.copytree(shards, tmp_path / "copy")
    victim = copy / "train/shard-000001.tar"
    original = victim.read_bytes()
    data = bytearray(original)
    data[740] ^= 0x01  # one bit of a pixel of the shard's first sample (its .npy payload), which still decodes
    victim.write_bytes(bytes(data))
    dm = module(copy)
    dm.setup()
    with pytest.raises(UserError, match=r"sample 64 of shard .*/shard-000001.tar \(split train\) fails its checksum"):
        dm.splits["train"][PER_SHARD]
    assert dm.splits["train"][PER_SHARD + 1][1] == module(shards).rank_loader().dataset[PER_SHARD + 1][1]
    as_older_index(copy)  # an older index: read unchecked, and a damaged .npy header still found
    data[600] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"sample 64 of shard .*train/shard-000001.tar cannot be decoded \(Cannot"):
        module(copy).rank_loader().dataset[PER_SHARD]
    data = bytearray(original)
    data[1024 + 10] ^= 0xFF  # the name in the second member's header
    victim.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"shard .*train/shard-000001.tar is corrupt: bad tar header checksum"):
        module(copy).rank_loader().dataset[PER_SHARD]  # the older index: the headers are walked
    shutil.copy(shards / "train/index.json", copy / "train/index.json")  # with spans, no header is read
    assert module(copy).rank_loader().dataset[PER_SHARD][1] == module(shards).rank_loader().dataset[PER_SHARD][1]
    victim.write_bytes(bytes(data[:-1024]))
    with pytest.raises(UserError, match=r"shard-000001.tar changed after its index was written \(\d+ bytes"):
        module(copy).rank_loader().dataset[PER_SHARD]


def test_the_prefetcher_yields_the_samplers_indices_keeps_five_units_and_clears_stale_spools(shards, tmp_path):
    """The prefetcher's units (local shards read by sample, 12 units of 10 samples) come out as they went in; 5
    stay on disk, a worker's spool finds a sample's members there, and a spool whose process ended is deleted."""
    index = ShardIndex.load(f"{shards}/train")
    host = socket.gethostname()
    stale, live = tmp_path / f"{host}-999999999-0123456789ab", tmp_path / f"{host}-{os.getpid()}-0123456789ab"
    stale.mkdir()
    live.mkdir()
    prefetcher = Prefetcher(index, tmp_path)
    assert not stale.exists() and live.exists()
    assert list(prefetcher.ahead(np.arange(k * 10, k * 10 + 10) for k in range(12))) == list(range(120))
    assert len(list(prefetcher.directory.glob("unit-*.want.npy"))) == 5
    fs, root = filesystem(str(shards / "train"))
    expected = read_samples(index, fs, root, np.array([115])).members(0)
    assert list(map(bytes, Spool(prefetcher.directory, 2).members(115))) == list(map(bytes, expected))
    assert Spool(prefetcher.directory, 2).members(5) is None  # its unit was deleted: the caller reads it


def test_shards_another_process_is_fetching_count_against_the_cache_limit(shards, tmp_path):
    """Loader workers fetching at the same time stay within data.cache_gb together: each reserves its shard's bytes
    before it fetches, and the others' eviction counts them; a reservation a killed process left counts for nothing."""
    fsspec.filesystem("memory").put(str(shards), "/reserving-digits", recursive=True)
    index = ShardIndex.load("memory://reserving-digits/train")
    cache = ShardCache(index, str(tmp_path), cache_bytes=int(2.5 * max(index.sizes)), keep_open=1)
    cache.shard(0)
    fetcher = subprocess.Popen(["sleep", "60"])  # another worker, fetching shard 5 now
    reserved = cache.dir / f"{RESERVED}{fetcher.pid}-shard-000005.tar.size"
    with open(reserved, "wb") as sparse:
        sparse.truncate(index.sizes[5])
    cache.shard(1)  # shard 0 + shard 5 being fetched + shard 1 > 2.5 shards: shard 0 goes
    assert sorted(p.name for p in cache.dir.glob("*.tar")) == ["shard-000001.tar"]
    # A reservation listed, then deleted by its fetcher before it is sized (a dangling link holds that moment still).
    (cache.dir / f"{RESERVED}{fetcher.pid}-shard-000004.tar.size").symlink_to(tmp_path / "fetched")
    cache.shard(3)  # it counts for nothing, not a crash; shard 5 being fetched + shard 3 leave no room for shard 1
    assert sorted(p.name for p in cache.dir.glob("*.tar")) == ["shard-000003.tar"]
    (cache.dir / f"{RESERVED}{fetcher.pid}-shard-000004.tar.size").unlink()
    fetcher.kill()
    fetcher.wait()
    cache.shard(2)  # the killed fetcher's reservation is deleted, not counted: shard 3 stays
    assert sorted(p.name for p in cache.dir.glob("*.tar")) == ["shard-000002.tar", "shard-000003.tar"]
    assert not list(cache.dir.glob(f"{RESERVED}*"))  # this process's own reservations ended with its fetches


def test_a_changed_shard_set_is_refused_mid_epoch(shards, tmp_path):
    dm = module(shards)
    dm.setup()
    sampler = dm.train_sampler(64, 1, 0)
    written = {"sampler": sampler.ORDER.replace(dm.indexes["train"].checksum[:16], "0" * 16), "global_batch_size": 64}
    with pytest.raises(
        UserError,
        match=r"stopped mid-epoch .* under the shard-window-v1 \(window 2, shards 0{16}\) sampler, now shard-window-v1 "
        r"\(window 2, shards \w{16}\): the shard set or data.window_shards changed since",
    ):
        resumed_steps(written, "at-13.ckpt", 1, 13, sampler)
    assert resumed_steps({"sampler": sampler.ORDER, "global_batch_size": 64}, "at-13.ckpt", 1, 13, sampler) == 5


def test_remote_shards_through_a_bounded_cache_and_a_changed_remote_shard(shards, tmp_path, caplog):
    """memory:// as the remote: the cache holds at most 2.5 shards' bytes, evicts, and reads the same samples."""
    memory = fsspec.filesystem("memory")
    memory.put(str(shards), "/remote-digits", recursive=True)
    shard_bytes = (shards / "train/shard-000000.tar").stat().st_size
    cache = tmp_path / "cache"
    remote_dm = module(
        "memory://remote-digits",
        cache_dir=str(cache),
        cache_gb=2.5 * shard_bytes / 2**30,
        num_workers=2,
        reads="shards",
    )
    local = global_batches(module(shards), 1, epoch=0)
    assert all(torch.equal(a, b) for a, b in zip(local, global_batches(remote_dm, 1, epoch=0), strict=True))
    assert "holds fewer than the 3 shards of memory://remote-digits/train a process keeps open" in caplog.text
    cached = list(cache.rglob("*.tar"))
    assert 0 < len(cached) <= 2 and sum(p.stat().st_size for p in cached) <= 2.5 * shard_bytes
    assert all(torch.is_tensor(remote_dm.splits["val"][i][0]) for i in range(0, EXACT_VAL, 16))  # its own folder
    cached = list(cache.rglob("*.tar"))  # the limit covers the whole cache: every split's folder together
    assert sum(p.stat().st_size for p in cached) <= 2.5 * shard_bytes
    changed = bytearray(memory.cat_file("/remote-digits/train/shard-000003.tar"))
    changed[-2000] ^= 1  # a sample's bytes, the size unchanged
    memory.pipe_file("/remote-digits/train/shard-000003.tar", bytes(changed))
    fresh = module("memory://remote-digits", cache_dir=str(tmp_path / "fresh"), reads="shards")
    fresh.setup()
    with pytest.raises(UserError, match=r"shard-000003.tar changed after its index was written \(sha256"):
        fresh.splits["train"][3 * PER_SHARD]
    memory.rm("/remote-digits", recursive=True)


def test_a_dead_remote_is_one_error_after_bounded_retries(monkeypatch):
    """Connection refused on every try (a closed local port): 5 tries, then one line naming the URL."""
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)
    with pytest.raises(UserError, match=r"127.0.0.1:9/shards/train/index.json could not be read after 5 tries"):
        module("http://127.0.0.1:9/shards").known_split_sizes()
    with pytest.raises(UserError, match=r"no train/, val/, test/ split with an index.json under data.url="):
        module("memory://nothing-here").setup()


def sharded_exact(shards: Path) -> list[str]:
    """The EXACT recipe on the digits shards: its splits are the converted ones, its augmentation a transform."""
    kept = [a for a in EXACT if not a.startswith(("data.augment=", "data.val_size=", "data.test_size="))]
    augment = "data.train_transform={_target_:testbed.data.random_shift_and_rotation}"
    return [*kept, "data=sharded", f"data.url={shards}", "data.window_shards=2", augment]


def two_nodes(args: list[str], run_dir: Path, env: dict[str, str]) -> None:
    """`python train.py` on 2 nodes x 2 processes: one torchrun per node on 127.0.0.1, each node its own cache."""
    port = free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2"]
    torchrun += ["--master_addr=127.0.0.1", f"--master_port={port}"]
    args = [*merged(args), "trainer.devices=2", "trainer.num_nodes=2"]
    nodes = [
        start([*torchrun, f"--node_rank={node}", "train.py", *args, f"data.cache_dir={run_dir}-node{node}"], env=env)
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=400)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]


@pytest.mark.slow
def test_sharded_training_equal_on_one_process_and_two_nodes_from_s3_and_resumes_across_devices_and_workers(
    shards, wds_shards, s3_endpoint, s3, tmp_path
):
    """float64, micro-batches of 16, 2 epochs (16 steps: the LR ramps over epoch 0, decays over epoch 1): 1 process
    without loader workers, on the converted shards in a local directory; 2 nodes x 2 processes with 2 workers each,
    on ShardWriter's tars (indexed as they are) from S3 by sample, saving mid-epoch at step 13 (5 of epoch 1's 8),
    the training split served at most once per epoch for the whole job; that checkpoint resumed on 1 process with 1
    worker, on those tars in a local directory. All three end with the same weights; the first two evaluate every
    validation and test sample once (the resumed run's weights are what it proves: it skips the test)."""
    # micro-batches of 16 on every topology; 2 epochs hold a mid-epoch resume at a changing LR, as 3 would
    two_epochs = ["trainer.max_epochs=2", "lr_schedule.warmup_epochs=1"]
    args = [*sharded_exact(shards), "data.max_per_device_batch_size=16", *two_epochs]
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    in_process([*args, "trainer.devices=1", "data.num_workers=0", f"hydra.run.dir={one}"])
    url = upload(wds_shards, s3_endpoint, "wds")
    s3.reset()
    remote = [*args, f"data.url={url}", "data.num_workers=2", *save_every("at13", 13), f"hydra.run.dir={two}"]
    two_nodes(remote, two, clean_env(**s3.env))
    assert (read_json(two / "plan.json")["world_size"], read_json(two / "plan.json")["num_nodes"]) == (4, 2)
    served = s3.sent_under("/bucket/wds/train/") - s3.sent_under("/bucket/wds/train/index.json")
    epochs = int([a for a in args if a.startswith("trainer.max_epochs=")][-1].split("=")[1])
    print(f"training split served {served / split_bytes(wds_shards, 'train'):.2f}x its size in {epochs} epochs")
    assert served <= 1.1 * epochs * split_bytes(wds_shards, "train")
    # One loader worker: its first indices are drawn as the loader starts, before Lightning sets the epoch.
    resume = [f"ckpt_path={two / 'steps/at-13.ckpt'}", f"hydra.run.dir={resumed}", f"data.url={wds_shards}"]
    resume.append("trainer.limit_test_batches=0")  # only its weights are compared: its test would only cost time
    in_process([*args, "trainer.devices=1", "data.num_workers=1", *resume])
    reference = weights(one / "checkpoints/last.ckpt")
    for other in (two, resumed):
        worst = assert_same_weights(reference, weights(other / "checkpoints/last.ckpt"), rtol=0, atol=TOLERANCE)
        print(f"{other.name}: largest weight difference from 1 process {worst:.1e}")
    for run_dir in (one, two):
        metrics = read_json(run_dir / "metrics.json")
        assert (metrics["val/samples"], metrics["test/samples"]) == (EXACT_VAL, EXACT_TEST)
    assert read_json(two / "metrics.json")["test/acc"] == pytest.approx(read_json(one / "metrics.json")["test/acc"])


def test_image_files_are_converted_unchanged_and_decoded(tmp_path):
    import tarfile

    from PIL import Image
    from torchvision.io import decode_image

    for label, color in (("cat", (200, 40, 0)), ("dog", (0, 40, 200))):
        for split in ("train", "val"):
            (tmp_path / "tree" / split / label).mkdir(parents=True)
            for i in range(3):
                Image.new("RGB", (40, 30), color).save(tmp_path / "tree" / split / label / f"{i}.jpg")
    out = tmp_path / "shards"
    assert convert(["data=image_tree", f"data.root={tmp_path / 'tree'}", f"out={out}", "samples_per_shard=4"]) == 0
    index = ShardIndex.load(f"{out}/train")
    assert (len(index), index.fields) == (6, ("0.jpg", "1.cls"))
    assert index.model_settings == {"net.num_classes": 2, "net.in_channels": 3}
    with tarfile.open(out / "train/shard-000001.tar") as tar:  # samples 4 and 5: dog/1.jpg and dog/2.jpg
        assert tar.extractfile("000000000005.0.jpg").read() == (tmp_path / "tree/train/dog/2.jpg").read_bytes()
    # A BMP (which ImageFolder lists and torchvision.io cannot decode) is stored re-encoded as PNG.
    bmp = tmp_path / "bmp"
    for split in ("train", "val"):
        (bmp / split / "cat").mkdir(parents=True)
        Image.new("RGB", (8, 6), (10, 20, 30)).save(bmp / split / "cat" / "0.bmp")
    assert convert(["data=image_tree", f"data.root={bmp}", f"out={bmp / 'shards'}"]) == 0
    assert ShardIndex.load(f"{bmp / 'shards'}/train").fields == ("0.png", "1.cls")
    pixels, _ = next(iter(module(bmp / "shards", global_batch_size=1).rank_loader()))
    assert torch.equal(pixels[0, :, 0, 0], torch.tensor([10, 20, 30]) / 255)
    dm = module(out, global_batch_size=2)
    dm.setup()
    image, label = dm.splits["train"][5]
    expected = decode_image(str(tmp_path / "tree/train/dog/2.jpg")).float() / 255
    assert label == 1 and image.dtype == torch.float32 and torch.equal(image, expected)
    # With mean and std, as ImageNet's: uint8 batches, normalised after the transfer.
    dm = module(out, global_batch_size=2, mean=IMAGENET_MEAN, std=IMAGENET_STD)
    images, labels = next(iter(dm.rank_loader(split="val")))
    assert images.dtype == torch.uint8
    normalised, _ = dm.on_after_batch_transfer((images, labels), 0)
    torch.testing.assert_close(normalised, normalize(images, IMAGENET_MEAN, IMAGENET_STD))
    assert normalised.dtype == torch.float32 and normalised.mean() < images.float().mean() / 255


def test_webdataset_reads_the_shards_as_its_own(shards):
    """The shards are WebDataset's format: its own loader finds the same samples, keys and fields."""
    wds = pytest.importorskip("webdataset")  # in the test extra

    urls = sorted(str(p) for p in (shards / "val").glob("shard-*.tar"))
    samples = list(wds.WebDataset(urls, shardshuffle=False, empty_check=False).decode())
    dm = module(shards)
    dm.setup()
    assert [int(s["__key__"]) for s in samples] == list(range(EXACT_VAL))
    for i in (0, 64, EXACT_VAL - 1):
        image, label = dm.splits["val"][i]
        assert torch.equal(torch.from_numpy(samples[i]["0.npy"]), image) and samples[i]["1.cls"] == label


@pytest.fixture(scope="module")
def wds_shards(shards, tmp_path_factory) -> Path:
    """The digits splits written again by webdataset's own ShardWriter (its keys, fields `cls` and `npy`, 64 to a
    tar, as the converter cut them), then indexed where they lie by `python -m scaleup.data.index`."""
    import webdataset as wds

    out = tmp_path_factory.mktemp("wds")
    dm = module(shards)
    dm.setup()
    for split, samples in dm.splits.items():
        (out / split).mkdir()
        with wds.ShardWriter(str(out / split / "part-%04d.tar"), maxcount=PER_SHARD, verbose=0) as sink:
            for i in range(len(samples)):
                image, label = samples[i]
                sink.write({"__key__": f"digit_{split}{i:05d}", "npy": image.numpy(), "cls": label})
    assert index_main([str(out)]) == 0
    return out


@pytest.mark.slow
def test_webdataset_writer_tars_indexed_as_they_are_read_as_the_converted_shards(shards, wds_shards, tmp_path, capsys):
    """The index finds ShardWriter's samples, fields (input first) and model settings without re-encoding, and
    the same global batches come out; a sample without the chosen fields is refused in one line naming it."""
    index = ShardIndex.load(f"{wds_shards}/train")
    assert (len(index), index.fields) == (EXACT_TRAIN, ("npy", "cls"))
    assert index.model_settings == ShardIndex.load(f"{shards}/train").model_settings
    assert all(map(torch.equal, global_batches(module(wds_shards), 2, 1), global_batches(module(shards), 2, 1)))
    import webdataset as wds

    with wds.TarWriter(str(tmp_path / "bad.tar")) as sink:
        sink.write({"__key__": "a", "npy": np.zeros(2), "cls": 1})
        sink.write({"__key__": "b", "npy": np.zeros(2)})
    capsys.readouterr()
    assert index_main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"error: sample 'b' of {tmp_path / 'bad.tar'} has the fields ['npy'], not ['npy', 'cls']: every sample "
        "needs the same fields (choose them with fields=...)\n"
    )


def upload(directory: Path, endpoint, name: str) -> str:
    """`directory` uploaded to the S3 endpoint through s3fs, as a user uploads a data set: its s3:// URL."""
    import s3fs

    with pytest.MonkeyPatch.context() as env:
        for key, value in endpoint.env.items():
            env.setenv(key, value)
        s3fs.S3FileSystem().put(str(directory), f"bucket/{name}", recursive=True)
    return f"s3://bucket/{name}"


@pytest.fixture(scope="module")
def s3_shards(shards, s3_endpoint) -> str:
    return upload(shards, s3_endpoint, "digits")


def split_bytes(shards: Path, split: str) -> int:
    return sum(p.stat().st_size for p in (shards / split).glob("*.tar"))


@pytest.mark.slow
def test_s3_with_loader_workers_trains_as_the_local_directory(shards, s3_shards, s3, tmp_path, caplog):
    """s3:// through AWS_ENDPOINT_URL with 2 forked loader workers (the default): the same metrics as the local
    directory, by sample (reads=auto) and by whole shards through the cache, each shard read there served once."""
    short = ["data=sharded", "data.window_shards=2", "data.num_workers=2"]
    short += ["trainer.max_steps=2", "trainer.limit_val_batches=0", "trainer.limit_test_batches=1", *QUICK]
    local = in_process([*short, f"data.url={shards}", f"hydra.run.dir={tmp_path / 'local'}"])
    assert "data.reads=shards: whole shards of " in caplog.text and "read in place" in caplog.text
    cache = tmp_path / "cache"
    remote = [*short, f"data.url={s3_shards}", f"data.cache_dir={cache}"]
    by_sample = in_process([*remote, f"hydra.run.dir={tmp_path}/samples"])
    assert "data.reads=samples: each rank fetches only its own samples of s3://bucket/digits" in caplog.text
    assert not list(cache.rglob("*.tar"))  # no shard copied whole
    s3.reset()
    by_shard = in_process([*remote, "data.reads=shards", f"hydra.run.dir={tmp_path}/shards"])
    results = [
        {k: v for k, v in metrics.items() if not k.startswith("perf/")} for metrics in (local, by_sample, by_shard)
    ]
    assert results[0] == results[1] == results[2] and "test/acc" in results[0]  # perf/: timings
    cached = sum(p.stat().st_size for p in cache.rglob("*.tar"))  # a folder per split
    indexes = sum((shards / split / "index.json").stat().st_size for split in ("train", "val", "test"))
    assert cached and s3.bytes_sent >= cached + indexes  # every shard in the cache came from S3
    assert s3.bytes_sent < cached + indexes + 64 * 1024  # ... once (the rest: listings)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_by_sample_each_rank_fetches_its_own_samples_once_ahead_of_its_loader(shards, s3_shards, s3, workers, tmp_path):
    """reads=samples over S3, 2 ranks of 2 epochs: exactly the local directory's global batches, and the bytes
    the endpoint serves for the training split, over both ranks, at most its size per epoch (the rank's next
    steps were prefetched to local disk: no sample fetched twice), tiny prefetch units to cross many."""
    remote = module(s3_shards, reads="samples", prefetch_mb=0.05, num_workers=workers, cache_dir=str(tmp_path))
    for epoch in (0, 1):
        assert all(map(torch.equal, global_batches(remote, 2, epoch), global_batches(module(shards), 2, epoch)))
    served = s3.sent_under("/bucket/digits/train/") - s3.sent_under("/bucket/digits/train/index.json")
    payload = sum(int(spans[:, :, 1].sum()) for spans in ShardIndex.load(f"{shards}/train").spans)
    trained = 512 / 513  # 8 steps of 64 of the 513 samples, each epoch
    assert 2 * trained * payload <= served <= 2 * split_bytes(shards, "train")


@pytest.mark.slow
def test_s3_503s_and_dropped_connections_that_clear_are_retried(shards, s3_shards, s3, monkeypatch, caplog, tmp_path):
    """503 SlowDown answers, then connections closed with no answer, 10 in a row (one s3fs read: its own 5 tries of
    1 or 2 requests): the template tries again with backoff, and the reads succeed once the endpoint recovers."""
    import s3fs
    from packaging.version import Version

    monkeypatch.setenv("SCALEUP_READ_BACKOFF_S", "0.01")
    s3.fail(3, status=503, path="val/index.json")
    assert len(ShardIndex.load(f"{s3_shards}/val")) == EXACT_VAL
    if Version(s3fs.__version__) >= Version("2026.3"):
        # s3fs's cat_file reads the size first (a HEAD, to read a large object in concurrent ranges): the 503s meet
        # that HEAD, an answer without a body, which s3fs passes on: the template's retries.
        assert s3.requests == 3 + 2  # HEAD and GET
        assert "val/index.json failed (OSError: [Errno 16] Service Unavailable); try 4 of 5 in 0.04 s" in caplog.text
    else:  # one GET, whose SlowDown answers s3fs retries itself
        assert s3.requests == 3 + 1
    s3.drop(10, path="val/shard-000001.tar")
    dm = module(s3_shards, cache_dir=str(tmp_path), reads="shards")
    dm.setup()
    image, label = dm.splits["val"][PER_SHARD]
    expected = module(shards).rank_loader(split="val").dataset[PER_SHARD]
    assert torch.equal(image, expected[0]) and label == expected[1]
    assert "val/shard-000001.tar failed (ConnectionClosedError: Connection was closed" in caplog.text
    by_sample = module(s3_shards, reads="samples").rank_loader(split="val").dataset
    s3.reset()
    s3.fail(2, status=503, path="val/shard-000002.tar")  # by sample: a ranged read meets two 503s, then succeeds
    image, label = by_sample[2 * PER_SHARD]
    expected = module(shards).rank_loader(split="val").dataset[2 * PER_SHARD]
    assert torch.equal(image, expected[0]) and label == expected[1] and s3.requests == 3


def entry_point(args: list[str], capsys) -> str:
    """Train as `python train.py` does, inside `exit_on_user_error` (here, without a new interpreter): the one
    `error:` line it prints, after checking that the run exits 2 with no traceback and no loader-worker wrapper."""
    with pytest.raises(SystemExit) as exit_:
        exit_on_user_error(in_process)(["data=sharded", "trainer.max_epochs=1", "trainer.limit_train_batches=1", *args])
    output = capsys.readouterr()
    assert exit_.value.code == 2, output.err[-3000:]
    assert "Traceback" not in output.err and "DataLoader worker" not in output.err, output.err[-3000:]
    (line,) = [line for line in output.err.splitlines() if line.startswith("error:")]
    return line


def test_a_dead_s3_endpoint_is_one_line_naming_the_url_after_bounded_retries(monkeypatch, capsys, caplog, tmp_path):
    """A closed loopback port as AWS_ENDPOINT_URL (botocore's EndpointConnectionError), 3 tries."""
    import s3fs

    with socket.socket() as closed:  # a port nothing listens on once it is closed
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_MAX_ATTEMPTS": "1",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    monkeypatch.setenv("SCALEUP_READ_TRIES", "3")
    monkeypatch.setenv("SCALEUP_READ_BACKOFF_S", "0.1")
    s3fs.S3FileSystem.clear_instance_cache()  # a client made for the live endpoint would be reused
    started = time.monotonic()
    try:
        line = entry_point(["data.url=s3://bucket/digits", f"hydra.run.dir={tmp_path}"], capsys)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    assert time.monotonic() - started < 20  # refused connections fail at once: the run, and 0.3 s of waits
    assert line.startswith(
        "error: s3://bucket/digits/train/index.json could not be read after 3 tries (EndpointConnectionError: Could "
        "not connect to the endpoint URL"
    ), line
    retry = r"index.json failed \(EndpointConnectionError: .*\); try (\d) of 3 in ([\d.]+) s"
    assert re.findall(retry, caplog.text) == [("2", "0.1"), ("3", "0.2")]


@pytest.mark.slow  # an end-to-end run
def test_remote_data_that_cannot_be_used_is_one_line_naming_why(shards, s3, monkeypatch, capsys, tmp_path):
    """No credentials at all, a bucket that does not exist, a URL without splits, an unreachable ftp:// host and a
    cache directory that cannot be created (remote shards read by 2 loader workers): each one line, exit 2."""
    import s3fs

    fsspec.filesystem("memory").put(str(shards), "/cached-digits", recursive=True)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        ftp = f"ftp://127.0.0.1:{closed.getsockname()[1]}/digits"
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("SCALEUP_READ_TRIES", "2")
    monkeypatch.setenv("SCALEUP_READ_BACKOFF_S", "0.01")
    nowhere = str(tmp_path / "nowhere")
    no_credentials = {"AWS_SHARED_CREDENTIALS_FILE": nowhere, "AWS_CONFIG_FILE": nowhere}
    no_credentials |= {"AWS_EC2_METADATA_DISABLED": "true", "AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None}
    copy = "convert a data set locally (python -m scaleup.data.convert data=<source> out=DIR), then copy DIR to"
    cases = [
        (
            no_credentials,
            ["data.url=s3://bucket/digits"],
            "error: s3://bucket/digits/train/index.json: no credentials found (Unable to locate credentials); give "
            "them as the storage's client expects (s3://: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE",
        ),
        (
            {},
            ["data.url=s3://nobucket/digits"],
            "error: data.url=s3://nobucket/digits: the bucket nobucket does not exist (or these credentials cannot "
            f"see it); check the URL, or create the bucket and {copy} s3://nobucket/digits",
        ),
        (
            {},
            ["data.url=s3://bucket/nothing"],
            f"error: no train/, val/, test/ split with an index.json under data.url=s3://bucket/nothing; {copy} "
            "s3://bucket/nothing",
        ),
        ({}, [f"data.url={ftp}"], f"error: {ftp} could not be read after 2 tries (ConnectionRefusedError"),
        (
            {},
            ["data.url=memory://cached-digits", "data.reads=shards", f"data.cache_dir={tmp_path}/file/cache"],
            f"error: data.cache_dir={tmp_path}/file/cache cannot be created (Not a directory): set it to a directory "
            "on local disk that you can write",
        ),
    ]
    try:
        for env, args, message in cases:
            with monkeypatch.context() as patch:
                for key, value in env.items():
                    if value is None:
                        patch.delenv(key)
                    else:
                        patch.setenv(key, value)
                s3fs.S3FileSystem.clear_instance_cache()  # a client made with other credentials would be reused
                line = entry_point([*args, "data.num_workers=2", f"hydra.run.dir={tmp_path / 'run'}"], capsys)
            assert line.startswith(message), line
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        fsspec.filesystem("memory").rm("/cached-digits", recursive=True)


@pytest.mark.slow
def test_a_flipped_byte_on_s3_or_in_the_cache_is_one_error_naming_the_sample(shards, s3_shards, s3, tmp_path):
    """One flipped payload byte, read by sample from the endpoint, and in a shard already in the cache."""
    import s3fs

    copy = shutil.copytree(shards, tmp_path / "flipped")
    victim = copy / "val/shard-000001.tar"
    data = bytearray(victim.read_bytes())
    data[740] ^= 0x01  # a pixel of sample 64 (the shard's first)
    victim.write_bytes(bytes(data))
    s3fs.S3FileSystem().put(str(copy), "bucket/flipped", recursive=True)
    flipped = r"sample 64 of shard s3://bucket/flipped/val/shard-000001.tar \(split val\) fails its checksum"
    with pytest.raises(UserError, match=flipped):
        module("s3://bucket/flipped", reads="samples").rank_loader(split="val").dataset[PER_SHARD]
    cache = tmp_path / "cache"
    dm = module(s3_shards, reads="shards", cache_dir=str(cache))
    assert (
        dm.rank_loader(split="val").dataset[PER_SHARD][1]
        == module(shards).rank_loader(split="val").dataset[PER_SHARD][1]
    )
    (cached,) = cache.rglob("shard-000001.tar")  # the downloaded copy (val: nothing else was read), sha256 checked
    cached.write_bytes(bytes(data))  # corrupted on the local disk since
    with pytest.raises(UserError, match=flipped.replace("flipped", "digits")):
        module(s3_shards, reads="shards", cache_dir=str(cache)).rank_loader(split="val").dataset[PER_SHARD]


def test_a_flipped_bit_read_in_a_loader_worker_is_one_line(shards, capsys, tmp_path):
    """A UserError raised in a DataLoader worker (here: a flipped bit of a validation sample, against its crc32) is
    one line naming the sample, shard and split, as without workers; the run never trains on the sample."""
    copy = shutil.copytree(shards, tmp_path / "shards")
    victim = copy / "val/shard-000000.tar"
    data = bytearray(victim.read_bytes())
    data[740] ^= 0x01  # one bit of a pixel of sample 0: it decodes, its crc32 differs
    victim.write_bytes(bytes(data))
    line = entry_point([f"data.url={copy}", "data.num_workers=2", *QUICK, f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    shard = r"error: sample 0 of shard .*/shards/val/shard-000000.tar \(split val\)"
    assert re.fullmatch(rf"{shard} fails its checksum: its 0.npy has crc32 [0-9a-f]{{8}}, the index says .*", line)


def test_images_of_different_sizes_without_a_transform_are_one_clear_error(shards):
    """ImageFolder shards store each image as it is: without a resizing transform, a batch of two sizes cannot be
    stacked. The loaders' collate says so, naming the sizes and the key to set."""
    collate = module(shards).collate_fn("val")
    assert collate([(torch.zeros(3, 8, 8), 0), (torch.ones(3, 8, 8), 1)])[0].shape == (2, 3, 8, 8)
    with pytest.raises(UserError) as raised:
        collate([(torch.zeros(3, 32, 40), 0), (torch.zeros(3, 28, 28), 1)])
    assert str(raised.value).startswith(
        "the val samples of data.url have different sizes ((3, 28, 28), (3, 32, 40)) and cannot form a batch: set "
        "data.eval_transform to a transform that resizes them to one size"
    )
