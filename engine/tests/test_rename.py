"""scripts/rename.py: the spellings it replaces, what it refuses, and a renamed clone that installs, tests, trains."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT

spec = importlib.util.spec_from_file_location("rename", ROOT / "scripts" / "rename.py")
rename = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rename)

NAME = rename.current_name(ROOT)  # this project's name today (it changes when the project is renamed)
GIT_USER = ["-c", "user.name=test", "-c", "user.email=test@example.com"]

# A small project named "oldpkg" with every kind of place a name sits in.
PROJECT = {
    "src/oldpkg/__init__.py": '"""oldpkg: a project."""\n',
    "src/oldpkg/models.py": (
        "import logging\n"
        "import os\n\n"
        'SEED = os.environ.get("OLDPKG_SEED")\n'
        'log = logging.getLogger("oldpkg.models")\n\n\n'
        "class OldpkgNet: ...\n\n\n"
        "class OldpkgnessCheck: ...  # oldpkgs, myoldpkg, oldpkg2: other words\n"
    ),
    "configs/model.yaml": "_target_: oldpkg.models.OldpkgNet\n",
    "pyproject.toml": '[project]\nname = "oldpkg"\n[project.optional-dependencies]\ndev = ["oldpkg[test]"]\n',
    "README.md": "# oldpkg\n\nWhat oldpkg does: `python -m oldpkg.train`.\n",
    "train.py": "from oldpkg.models import OldpkgNet\n",
    "LICENSE": "MIT License\n\nCopyright (c) 2026 The oldpkg authors\n\nPermission is hereby granted.\n",
    "CHANGELOG.md": "# Changelog\n\n## [Unreleased]\n\n### Added\n- A thing in oldpkg.\n\n## [0.1.0]\n- First.\n",
}
# The template's own files in a clone, which name the example package and which a rename leaves as they are
TEMPLATE_OWN = {
    "engine/src/scaleup/plain.py": '"""Stored targets of oldpkg move to the renamed package."""\n',
    "engine/tests/test_old.py": 'assert stored == "oldpkg"\n',
    "docs/contract.md": "Your code lives in `src/oldpkg/`.\n",
    "copier.yml": "# copier copies src/oldpkg/\n",
    "project/README.md": "# oldpkg\n",
    "scripts/rename.py": 'TEMPLATE_NAME = "oldpkg"\n',
}


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *GIT_USER, *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def write_project(root: Path, files: dict[str, str], commit: bool = True) -> Path:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    if commit:
        git(root, "init", "-q")
        git(root, "add", "-A")
        git(root, "commit", "-q", "-m", "start")
    return root


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """One committed copy of PROJECT, shared by the refusal tests (a refusal must leave it untouched)."""
    return write_project(tmp_path_factory.mktemp("project"), PROJECT)


def test_renames_package_imports_targets_and_every_spelling(tmp_path, capsys):
    root = write_project(tmp_path, PROJECT | TEMPLATE_OWN)
    assert rename.main(["new_pkg"], root=root) == 0
    out = capsys.readouterr().out

    assert not (root / "src/oldpkg").exists()
    assert (root / "src/new_pkg/models.py").read_text() == (
        "import logging\n"
        "import os\n\n"
        'SEED = os.environ.get("NEW_PKG_SEED")\n'
        'log = logging.getLogger("new_pkg.models")\n\n\n'
        "class NewPkgNet: ...\n\n\n"
        "class OldpkgnessCheck: ...  # oldpkgs, myoldpkg, oldpkg2: other words\n"
    )
    assert (root / "src/new_pkg/__init__.py").read_text() == '"""new_pkg: a project."""\n'
    assert (root / "configs/model.yaml").read_text() == "_target_: new_pkg.models.NewPkgNet\n"
    assert (root / "pyproject.toml").read_text() == PROJECT["pyproject.toml"].replace("oldpkg", "new_pkg")
    assert (root / "README.md").read_text() == "# new_pkg\n\nWhat new_pkg does: `python -m new_pkg.train`.\n"
    assert (root / "train.py").read_text() == "from new_pkg.models import NewPkgNet\n"
    # The original copyright line stays (the licence requires it); the history keeps the names it was written with.
    assert "Copyright (c) 2026 The oldpkg authors" in (root / "LICENSE").read_text()
    assert re.search(r"^Copyright \(c\) \d{4} The new_pkg authors\nCopyright \(c\) 2026 The oldpkg authors$",
                     (root / "LICENSE").read_text(), re.MULTILINE)  # fmt: skip
    assert (root / "CHANGELOG.md").read_text() == (
        "# Changelog\n\n## [Unreleased]\n\n"
        "### Changed\n- Renamed the project from `oldpkg` to `new_pkg` (`python scripts/rename.py new_pkg`).\n\n"
        "### Added\n- A thing in oldpkg.\n\n## [0.1.0]\n- First.\n"
    )
    # Staged as a move, so `git diff --staged` shows it as one.
    assert "RM src/oldpkg/models.py -> src/new_pkg/models.py" in git(root, "status", "--porcelain")

    assert "moved   src/oldpkg -> src/new_pkg" in out
    assert "edited  configs/model.yaml (2 replacement(s))" in out
    assert "edited  src/new_pkg/models.py (3 replacement(s))" in out
    # Words that only contain the old name are left, and listed for a look by hand.
    assert "left as they are (check by hand):\n  src/new_pkg/models.py:11: class OldpkgnessCheck" in out
    # A clone of the template: its own files untouched, and the install command its engine folder needs
    assert {path: (root / path).read_text() for path in TEMPLATE_OWN} == TEMPLATE_OWN
    assert "engine/" not in out.split("next steps:")[0]
    assert 'python -m pip install -c constraints.txt -e "./engine[test]" -e ".[test]"' in out
    assert 'git add -A && git commit -m "Rename oldpkg to new_pkg"' in out


def test_changelog_entry_joins_an_existing_changed_list_or_starts_the_section():
    with_changed = "## [Unreleased]\n\n### Changed\n- X.\n\n## [0.1.0]\n- Y.\n"
    assert rename.add_changelog_entry(with_changed, "a", "b") == (
        "## [Unreleased]\n\n### Changed\n- Renamed the project from `a` to `b` (`python scripts/rename.py b`).\n"
        "- X.\n\n## [0.1.0]\n- Y.\n"
    )
    released_only = "# Changelog\n\n## [0.1.0]\n- Y.\n"
    assert rename.add_changelog_entry(released_only, "a", "b") == (
        "# Changelog\n\n## [Unreleased]\n\n### Changed\n"
        "- Renamed the project from `a` to `b` (`python scripts/rename.py b`).\n\n## [0.1.0]\n- Y.\n"
    )


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("My-Net", "'My-Net' is not a valid package name: use lowercase letters, digits and underscores"),
        ("OldPkg", "'OldPkg' is not a valid package name"),
        ("1net", "'1net' is not a valid package name"),
        ("class", "'class' is a Python keyword and cannot be imported"),
        ("oldpkg", "the project is already named 'oldpkg'"),
        ("json", "'json' would shadow Python's standard library module 'json'"),
        ("torch", "'torch' is already an installed module"),
        ("train", "'train' is already used at the project root (train.py)"),
        ("models", "'models' already appears as a word in the project (configs/model.yaml:1: _target_: oldpkg.models"),
        ("logging", "'logging' would shadow Python's standard library module"),
        ("target", "'target' already appears as a word in the project (configs/model.yaml:1: _target_: oldpkg"),
    ],
)
def test_refuses_names_that_are_invalid_or_collide(project, capsys, name, message):
    assert rename.main([name], root=project) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert git(project, "status", "--porcelain") == ""
    assert (project / "src/oldpkg/models.py").read_text() == PROJECT["src/oldpkg/models.py"]


@pytest.mark.parametrize("change", ["untracked", "modified", "staged"])
def test_refuses_a_tree_with_uncommitted_changes(tmp_path, capsys, change):
    root = write_project(tmp_path, PROJECT)
    if change == "untracked":
        (root / "notes.txt").write_text("oldpkg notes\n")
    else:
        (root / "README.md").write_text("# oldpkg\n\nmy edits\n")
    if change == "staged":
        git(root, "add", "README.md")
    before = git(root, "status", "--porcelain")

    assert rename.main(["new_pkg"], root=root) == 2
    assert capsys.readouterr().err == (
        "error: the work tree has uncommitted changes (see `git status`); commit them first, so the rename can be "
        "reviewed with `git diff` and undone with `git reset --hard` without losing them\n"
    )
    assert git(root, "status", "--porcelain") == before
    assert (root / "src/oldpkg/models.py").is_file() and not (root / "src/new_pkg").exists()


def test_refuses_a_tree_outside_git(tmp_path, capsys):
    root = write_project(tmp_path, PROJECT, commit=False)
    assert rename.main(["new_pkg"], root=root) == 2
    assert capsys.readouterr().err.startswith(f"error: {root} is not a git work tree; run `git init && git add -A")
    assert (root / "src/oldpkg/models.py").read_text() == PROJECT["src/oldpkg/models.py"]


def test_an_update_that_stops_part_way_says_how_to_restore_the_project(tmp_path, capsys):
    """In `copier update` the task may run on the project after copier wrote the next version over it."""
    package = f"src/{rename.TEMPLATE_NAME}/models.py"
    template = write_project(tmp_path / "template", {package: "x = 1\n"})
    root = write_project(tmp_path / "project", {package: "x = 1\n"}, commit=False)
    (root / "src/new_pkg/models.py").mkdir(parents=True)  # in the way of the move
    assert rename.main(["new_pkg", "--template", str(template), "--operation", "update"], root=root) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Is a directory" in err and err.count("\n") == 1, err
    assert err.endswith("; the update stopped part-way: `git reset --hard && git clean -fd` restores the project\n")


def test_a_made_project_pins_the_engine_to_the_template_commit_and_an_update_moves_the_pin(tmp_path, capsys):
    """copier's task: the project's own files from project/ replace the template's, and every requirement on the
    engine, extras too, becomes a direct reference to the engine of the template's commit; on an update, to the
    new commit, whatever the rendered pyproject said before."""
    name = rename.TEMPLATE_NAME
    pyproject = (
        f'[project]\nname = "{name}"\ndependencies = ["scaleup-engine", "numpy"]\n'
        f'[project.optional-dependencies]\nray = ["scaleup-engine[ray]"]  # {name}\ndev = ["{name}[test]"]\n'
    )
    files = {
        f"src/{name}/__init__.py": "",
        "pyproject.toml": pyproject,
        "README.md": f"# The template's own README, naming {name}\n",
        "project/README.md": f"# {name}\n\nThe engine's documentation: ENGINE_DOCS\n",
    }
    template = write_project(tmp_path / "template", files)
    first = git(template, "rev-parse", "HEAD").strip()
    root = write_project(tmp_path / "project", {k: v for k, v in files.items() if "project/" not in k}, commit=False)
    (root / rename.ANSWERS).write_text(f"_commit: v1.0.0\n_src_path: {template.name}\n")  # relative, as typed

    def made(commit: str, operation: str) -> str:
        args = ["new_pkg", "--template", str(template), "--commit", commit, "--operation", operation]
        assert rename.main(args, root=root) == 0
        return (root / "pyproject.toml").read_text()

    pin = f"git+file://localhost{template}@{first}#subdirectory=engine"
    assert made(first, "copy") == (
        f'[project]\nname = "new_pkg"\ndependencies = ["scaleup-engine @ {pin}", "numpy"]\n'
        f'[project.optional-dependencies]\nray = ["scaleup-engine[ray] @ {pin}"]  # new_pkg\ndev = ["new_pkg[test]"]\n'
    )
    assert f"pinned  2 scaleup-engine requirement(s) in pyproject.toml to {pin}\n" in capsys.readouterr().out
    docs = f"file://localhost{template}/docs"
    assert (root / "README.md").read_text() == f"# new_pkg\n\nThe engine's documentation: {docs}\n"
    assert (root / rename.ANSWERS).read_text() == f"_commit: v1.0.0\n_src_path: {template}\n"
    assert not (root / "project").exists()

    # An update renders the next version's pyproject (unpinned) and, in copier's scratch copies, the old one again
    # (pinned): both end pinned to the commit the task is given.
    (template / "README.md").write_text("# The next version\n")
    git(template, "commit", "-qam", "next")
    second = git(template, "rev-parse", "HEAD").strip()
    assert made(second, "update").count(f"@ git+file://localhost{template}@{second}#subdirectory=engine") == 2
    (root / "pyproject.toml").write_text(pyproject)
    assert made(second, "update").count(f"@ git+file://localhost{template}@{second}#subdirectory=engine") == 2
    assert capsys.readouterr().out == ""  # copier's scratch copies, outside git: silent
    git(root, "init", "-q")  # the project itself, which copier updates only in git: says what it did
    made(second, "update")
    assert capsys.readouterr().out.startswith(f"renamed {name} -> new_pkg: ")
    # Without --commit (a template run by hand), the commit its checkout is at
    assert rename.main(["new_pkg", "--template", str(template), "--operation", "update"], root=root) == 0
    assert f"@{second}#subdirectory=engine" in (root / "pyproject.toml").read_text()


@pytest.mark.parametrize(
    ("source", "url"),
    [
        ("gh:someone/template", "https://github.com/someone/template.git"),
        ("gl:someone/template.git", "https://gitlab.com/someone/template.git"),
        ("https://example.com/someone/template.git", "https://example.com/someone/template.git"),
        ("git+https://example.com/t.git", "https://example.com/t.git"),
        ("git@github.com:someone/template.git", "ssh://git@github.com/someone/template.git"),
        ("/srv/templates/scaleup", "file://localhost/srv/templates/scaleup"),
    ],
)
def test_the_pin_names_the_template_as_a_url_pip_clones(source, url):
    assert rename.git_url(source) == url


def test_every_spelling_of_the_name_in_this_project_is_one_the_rename_replaces():
    """A spelling the rules miss (a second capital inside the name, the name glued to a word) would survive a rename."""
    missed = []
    for path in rename.tracked_files(ROOT):
        text = rename.read_text(ROOT / path)
        if path in rename.KEEP_HISTORY or text is None:
            continue
        renamed, _ = rename.replace_name(text, NAME, "x")
        missed += [f"{path}: {line.strip()}" for line in renamed.splitlines() if NAME in line.lower()]
    assert not missed, "\n".join(missed)


def test_stored_targets_move_to_the_renamed_package(caplog):
    """A checkpoint's config names the package it trained under; eval/export/resume find each target in today's,
    quietly: a stored target that no longer imports is expected, not an error to log."""
    from scaleup.config.plain import retarget

    stored = {
        "_target_": "oldpkg.models.ImageClassifier",  # gone: found in today's package
        "net": {"_target_": f"{NAME}.models.nets.DigitsCNN", "width": 32},  # still imports: kept
        "optimizer": {"_target_": "torch.optim.SGD", "lr": 0.1},
        "hooks": [{"_target_": "oldpkg.nowhere.Thing"}],  # in neither: kept, so its error names it
    }
    assert retarget(stored, NAME) == {
        "_target_": f"{NAME}.models.ImageClassifier",
        "net": {"_target_": f"{NAME}.models.nets.DigitsCNN", "width": 32},
        "optimizer": {"_target_": "torch.optim.SGD", "lr": 0.1},
        "hooks": [{"_target_": "oldpkg.nowhere.Thing"}],
    }
    # A checkpoint of 0.1.0, from before the two packages: its model and data module moved to your package.
    digits = {"_target_": "scaleup.data.DigitsDataModule"}
    assert retarget(digits, NAME) == {"_target_": f"{NAME}.data.DigitsDataModule"}
    assert caplog.records == []
