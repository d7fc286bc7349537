"""The engine keeps what it promises across minor versions: its surface (scaleup.surface) is the one recorded in
engine/src/scaleup/surface.json for `scaleup.__version__`'s minor.

Fast: the engine's source is parsed, not imported, and Hydra composes the configs in this process. The rules
themselves are checked on made-up changes of the surface, not on edited files.
"""

from __future__ import annotations

import copy
import functools
import json

import pytest

import scaleup
from conftest import PROJECT
from scaleup import surface


@functools.cache
def current() -> dict:
    return surface.surface(PROJECT / "configs")


def changed(edit) -> dict:
    """The current surface as JSON would give it back, with `edit` applied."""
    tree = copy.deepcopy(json.loads(json.dumps(current())))
    edit(tree)
    return tree


def recorded_now() -> dict:
    """A record of the current surface at the engine's own version."""
    return {"version": surface.release(scaleup.__version__), "surface": json.loads(json.dumps(current()))}


def test_the_surface_is_the_recorded_one():
    """On failure the message says what changed, whether a minor release may change it, and what to do."""
    problem = surface.verdict(surface.load(), current(), scaleup.__version__)
    assert problem is None, problem


def test_the_surface_holds_each_kind_of_promise():
    now = current()
    assert {"GlobalBatchDataModule", "StageMetrics", "UserError"} <= set(now["api"])
    assert {"seed", "ckpt_path", "trainer.devices", "strategy.name", "monitor.metric"} <= set(
        now["config"]["jobs"]["train"]
    )
    assert not any(key.split(".")[0] in ("model", "data") for key in now["config"]["jobs"]["train"])
    assert "strategy.sharding" in now["config"]["groups"]["strategy/fsdp"]
    assert "trainer.fast_dev_run" in now["config"]["groups"]["debug/fdr"]  # a `# @package _global_` option
    assert now["commands"]["python train.py"] == {"calls": ["scaleup.entry:main"], "config": "train"}
    assert now["commands"]["python -m scaleup.data.convert"]["options"] == ["out", "samples_per_shard", "workers"]
    assert "num_workers" in now["commands"]["python -m scaleup.distributed.ray_train"]["options"]
    assert now["commands"]["python -m scaleup.data.index"]["options"] == ["fields"]
    assert now["commands"]["python -m scaleup.check_equivalence"]["options"] == ["--float32"]
    checkpoint, shards = now["formats"]["checkpoint"], now["formats"]["shards"]
    assert checkpoint["scaleup"] == {"config": None, "plan": None} and "global_batch_size" in checkpoint["plan"]
    assert checkpoint["sampler_order"] == "feistel-v1" and checkpoint["sharded"]["METADATA"] == "meta.pt"
    assert shards["FORMAT"] == "scaleup-shards-v1" and shards["index"]["__kind__"] == "wids-shard-index-v1"
    assert shards["shard_entry"] == ["crc32", "filesize", "nsamples", "sha256", "spans", "url"]


def test_a_removed_api_name_breaks_the_minor():
    problem = surface.verdict(recorded_now(), changed(lambda s: s["api"].remove("StageMetrics")), "0.3.1")
    assert "api: StageMetrics removed" in problem and 'set __version__ = "0.4.0"' in problem
    assert surface.RECORD_COMMAND in problem


def test_a_renamed_config_key_breaks_the_minor():
    def rename(s):
        keys = s["config"]["jobs"]["train"]
        keys[keys.index("checkpoint.dirpath")] = "checkpoint.directory"

    added, broken = surface.differences(recorded_now()["surface"], changed(rename))
    assert added == ["config.jobs.train: checkpoint.directory"]
    assert broken == ["config.jobs.train: checkpoint.dirpath removed"]
    problem = surface.verdict(recorded_now(), changed(rename), scaleup.__version__)
    assert "checkpoint.dirpath removed" in problem and "checkpoint.directory" in problem


def test_a_removed_group_option_or_command_option_breaks_the_minor():
    def remove(s):
        del s["config"]["groups"]["strategy/fsdp"]
        s["commands"]["python -m scaleup.distributed.ray_train"]["options"].remove("address")

    assert surface.differences(recorded_now()["surface"], changed(remove))[1] == [
        "commands.python -m scaleup.distributed.ray_train.options: address removed",
        "config.groups: strategy/fsdp removed",
    ]


def test_a_changed_checkpoint_format_breaks_the_minor():
    def bump(s):
        s["formats"]["checkpoint"]["sampler_order"] = "feistel-v2"

    problem = surface.verdict(recorded_now(), changed(bump), "0.3.0")
    assert 'formats.checkpoint.sampler_order changed: "feistel-v1" -> "feistel-v2"' in problem
    assert "0.4.0" in problem


def test_an_added_name_is_allowed_within_the_minor(tmp_path):
    """It needs recording (so that removing it later is caught), not a new minor."""
    grown = changed(lambda s: s["api"].append("NewHelper"))
    assert surface.differences(recorded_now()["surface"], grown) == (["api: NewHelper"], [])
    problem = surface.verdict(recorded_now(), grown, scaleup.__version__)
    assert "api: NewHelper" in problem and "no version bump" in problem and "__version__ =" not in problem
    path = tmp_path / "surface.json"
    path.write_text(json.dumps(recorded_now()))
    assert surface.record(grown, scaleup.__version__, path) is None
    assert surface.verdict(surface.load(path), grown, scaleup.__version__) is None


def test_recording_a_breaking_change_needs_the_next_minor(tmp_path):
    path = tmp_path / "surface.json"
    path.write_text(json.dumps(recorded_now()))
    shrunk = changed(lambda s: s["api"].remove("UserError"))
    assert "api: UserError removed" in surface.record(shrunk, "0.3.2", path)
    assert surface.load(path) == recorded_now()  # refused: nothing written
    assert surface.record(shrunk, "0.4.0", path) is None
    assert surface.load(path) == {"version": "0.4", "surface": shrunk}
    # A bumped engine with the old record: re-record for the new minor.
    problem = surface.verdict(recorded_now(), current(), "0.4.0")
    assert f"records the surface of {surface.release(scaleup.__version__)}" in problem and "re-record" in problem


@pytest.mark.parametrize(("version", "bump"), [("0.3.0", "0.4.0"), ("0.3.7", "0.4.0"), ("1.2.3", "2.0.0")])
def test_the_breaking_digit(version, bump):
    assert surface.next_breaking(version) == bump
