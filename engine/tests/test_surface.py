"""The engine keeps what its last release promised a project: the Python names it imports and the config keys it sets.

- The Python surface, read by griffe (parsed, not imported): `scaleup.api` (what src/<your project>/ imports),
  `scaleup.entry.main` (train.py, eval.py, export.py) and `scaleup.testing` (the project's tests). Griffe's
  `find_breaking_changes` compares each with the same object at the last release: a removed name, a removed or
  reordered parameter, a new required one, a changed default or kind breaks.
- The config keys: every key of the composed train, eval and export configs (the project's own `model` and `data`
  groups left out) and each option of the engine's config groups (`strategy=fsdp`), listed in config_keys.txt
  beside this file. The list is regenerated, after a change of the engine's configs, by

      python engine/tests/test_surface.py

  and the diff shows the change to review.

The last release is the newest `v*` tag reachable from HEAD; before its minor's first tag, the commit that set
`scaleup.__version__` to what it is now. Semantic versioning, 0.x: the minor is the breaking digit. Against a
release of the same minor nothing may break; against an earlier one (or the minor's start, not yet released) each
break must be named in CHANGELOG.md's [Unreleased] section, which tells users what to do.
"""

from __future__ import annotations

import functools
import re
import subprocess
import tarfile
from pathlib import Path

import griffe
import pytest

import scaleup
from conftest import PROJECT, ROOT, TESTS

KEYS = TESTS / "config_keys.txt"
REGENERATE = "python engine/tests/test_surface.py"
PROMISED = ("api", "entry.main", "testing")  # under `scaleup`: what a project imports
JOBS = ("train", "eval", "export")
PROJECT_GROUPS = ("model", "data")  # groups of the project's own, not the engine's


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


def breaking_digit(version: str) -> str:
    """`0.3` for 0.3.x, `1` for 1.x: what a release may change only by moving it."""
    major, minor = version.lstrip("v").split(".")[:2]
    return f"{major}.{minor}" if major == "0" else major


@functools.cache
def last_release() -> tuple[str, bool]:
    """(git ref, whether it is a release of the working tree's minor); the test is skipped where the repository
    has no history to compare with, and fails in a shallow clone (whose one commit reads as the start of all)."""
    try:
        shallow = git("rev-parse", "--is-shallow-repository") == "true"
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no release to compare with")
    if shallow:
        pytest.fail("a shallow clone has no release to compare with: git fetch --unshallow --tags (CI: fetch-depth: 0)")
    version = scaleup.__version__
    tags = git("tag", "--merged", "HEAD", "--sort=-v:refname", "--list", "v[0-9]*").split()
    if tags and breaking_digit(tags[0]) == breaking_digit(version):
        return tags[0], True
    started = git("log", "--format=%H", f'-S__version__ = "{version}"', "--", "engine/src/scaleup/__init__.py")
    if started:
        return started.split()[-1], False  # the oldest commit that set it: where this minor began
    if tags:
        return tags[0], False
    pytest.skip(f"scaleup {version} is not committed yet and no release is tagged: nothing to compare with")


def unreleased_changes() -> str:
    """CHANGELOG.md's [Unreleased] section."""
    text = (ROOT / "CHANGELOG.md").read_text()
    return text.split("## [Unreleased]", 1)[1].split("\n## [", 1)[0]


def named(name: str, changelog: str) -> bool:
    """`name` is a word of some `code` in the changelog (`scaleup.api.TopKAccuracy`, `data.name=auto`)."""
    return re.search(rf"`[^`\n]*\b{re.escape(name)}\b[^`\n]*`", changelog) is not None


def kept(breaks: list[tuple[str, str]]) -> None:
    """Fails unless nothing broke, or (against the start of this minor or an earlier minor) each break is named in
    the CHANGELOG; the message says what broke and what to do."""
    ref, same_minor = last_release()
    changelog = unreleased_changes()
    unannounced = [what for what, name in breaks if same_minor or not named(name, changelog)]
    assert not unannounced, (
        f"Breaking changes since {ref[:12]}: "
        + "; ".join(unannounced)
        + (
            f". {ref} is a release of this minor: restore them, or set __version__ to the next minor in "
            "engine/src/scaleup/__init__.py and say in CHANGELOG.md what replaces each."
            if same_minor
            else ". Say in CHANGELOG.md's [Unreleased] section what replaces each (name it there), or restore it."
        )
    )


def promised(loaded: griffe.Object) -> dict[str, griffe.Object]:
    """The promised objects that a loaded `scaleup` package has."""
    found = {}
    for path in PROMISED:
        try:
            found[path] = loaded[path]
        except KeyError:
            continue
    return found


def python_breaks(old: dict[str, griffe.Object], new: dict[str, griffe.Object]) -> list[tuple[str, str]]:
    """(what broke, the name the CHANGELOG would give: a parameter's or the object's) for each break. A value that
    changed (a constant such as `scaleup.testing.QUICK`) is not a break: names, kinds and signatures are."""
    breaks = [(f"scaleup.{path} removed", path.split(".")[-1]) for path in old if path not in new]
    for path in old.keys() & new.keys():
        for found in griffe.find_breaking_changes(old[path], new[path]):
            if found.kind is griffe.BreakageKind.ATTRIBUTE_CHANGED_VALUE:
                continue
            name = getattr(found.old_value if found.old_value is not None else found.new_value, "name", found.obj.name)
            detail = f" ({name})" if name != found.obj.name else ""
            breaks.append((f"{found.obj.path}: {found.kind.value}{detail}", name))
    return breaks


def engine_source_at(ref: str, into: Path) -> Path:
    """engine/src as commit `ref` holds it, extracted under `into`. `git archive` only reads the repository, where
    griffe.load_git adds a worktree and a branch to it while it loads (worktrees of one repository share those)."""
    archive = into / "engine.tar"
    git("archive", f"--output={archive}", ref, "engine/src")
    with tarfile.open(archive) as tar:
        tar.extractall(into, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return into / "engine" / "src"


def test_what_the_last_release_promised_in_python_is_kept(tmp_path):
    ref, _ = last_release()
    options = {"resolve_aliases": True, "allow_inspection": False}
    old = promised(griffe.load("scaleup", search_paths=[engine_source_at(ref, tmp_path)], **options))
    new = promised(griffe.load("scaleup", search_paths=[ROOT / "engine" / "src"], **options))
    kept(python_breaks(old, new))


def config_keys() -> list[str]:
    """`<job> <key>` for each key of the project's composed job configs, and `option <group>=<option>` for each
    option of the engine's config groups."""
    from omegaconf import OmegaConf

    from scaleup.config.project import compose_project

    def leaves(tree: object, prefix: str = "") -> list[str]:
        if not isinstance(tree, dict) or not tree:  # an empty mapping is a key one fills in
            return [prefix.rstrip(".")] if prefix else []
        return [key for name, value in tree.items() for key in leaves(value, f"{prefix}{name}.")]

    lines = []
    for job in JOBS:
        tree = OmegaConf.to_container(compose_project(job, configs=PROJECT / "configs", hydra=False), resolve=False)
        for group in PROJECT_GROUPS if job == "train" else ():
            tree.pop(group, None)
        lines += sorted(f"{job} {key}" for key in leaves(tree))
    conf = ROOT / "engine" / "src" / "scaleup" / "conf"
    options = (  # a `_`-named file is a part the group's options share, no option of its own
        f"{path.parent.relative_to(conf).as_posix()}={path.stem}"
        for path in conf.glob("**/*.yaml")
        if path.stem[:1] != "_"
    )
    return lines + sorted(f"option {option}" for option in options)


def listed(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_the_config_keys_are_the_listed_ones():
    """config_keys.txt is what the engine's configs compose to now: on a change, regenerate it and review the diff."""
    now, recorded = config_keys(), listed(KEYS.read_text())
    added = [key for key in now if key not in recorded]
    removed = [key for key in recorded if key not in now]
    assert not added and not removed, (
        f"The config keys changed: added {added}, removed {removed}. Regenerate {KEYS.name} with `{REGENERATE}` "
        "(a removed key breaks users' configs and overrides: see this module's docstring)."
    )


def test_what_the_last_release_promised_in_config_keys_is_kept():
    ref, _ = last_release()
    try:
        released = listed(git("show", f"{ref}:{KEYS.relative_to(ROOT).as_posix()}"))
    except subprocess.CalledProcessError:
        pytest.skip(f"{ref[:12]} has no {KEYS.name}")
    removed = [key for key in released if key not in listed(KEYS.read_text())]
    kept([(f"{key} removed", key.split()[-1]) for key in removed])


@pytest.mark.parametrize(("version", "digit"), [("0.3.0", "0.3"), ("v0.3.7", "0.3"), ("1.2.3", "1")])
def test_the_breaking_digit(version, digit):
    assert breaking_digit(version) == digit


if __name__ == "__main__":
    header = f"# The config keys a project sets; engine/tests/test_surface.py compares. Regenerate: {REGENERATE}\n"
    KEYS.write_text(header + "\n".join(config_keys()) + "\n")
    print(f"wrote {KEYS}")
