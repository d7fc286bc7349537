"""Projects made with `copier copy`: the user's code with the engine pinned, installed from the pin, tested, updated.

The template is this tree as it is on disk, a git repository of its own with two tags: v1.0.0, and v1.1.0, which
changes the engine's code and version. Two projects are made from v1.0.0 once per session (`made`) and only read:
`mynet`, and `othernet` beside it. A test that changes a project works on a clone of it.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import site
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import ROOT, check, clean_env, in_process, made_once, read_json
from scaleup.data.convert import main as convert

# Skipped without copier, which is not imported here: collecting this file imports nothing it does not need.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("copier") is None, reason="copier is not installed")

NAMES = ("mynet", "othernet")
NEXT_VERSION = "99.1.0"  # engine/src/scaleup/__init__.py's __version__ in the template's v1.1.0
ENGINE_FIX = "engine/src/scaleup/plan/batch.py"  # what v1.1.0 changes in the engine's code
FIX = "# the engine's fix in v1.1.0\n"
SKELETON_FIX = "configs/train.yaml"  # ... and in the files a project holds
# What a project holds of the template's own: nothing
TEMPLATE_ONLY = ("engine", "benchmarks", "deploy", "docs", "project", "CHANGELOG.md", "constraints-oldest.txt")
# copier commits in its scratch repositories: a machine without a git identity must not fail them.
IDENTITY = {f"GIT_{who}_{what}": value for who in ("AUTHOR", "COMMITTER") for what, value in
            (("NAME", "test"), ("EMAIL", "test@example.com"))}  # fmt: skip


def project_env() -> dict[str, str]:
    """The environment of a user's shell: no path to this checkout (its engine, its engine/tests/)."""
    env = {**clean_env(), **IDENTITY}
    del env["PYTHONPATH"]
    return env


def sh(cwd: Path, *command: str | Path) -> subprocess.CompletedProcess:
    return check(subprocess.run([str(c) for c in command], cwd=cwd, env=project_env(), capture_output=True, text=True))


def commit(cwd: Path, message: str, tag: str | None = None) -> str:
    sh(cwd, "git", "add", "-A")
    sh(cwd, "git", "commit", "-q", "-m", message)
    if tag:
        sh(cwd, "git", "tag", tag)
    return sh(cwd, "git", "rev-parse", "HEAD").stdout.strip()


def make_template_and_projects(root: Path) -> None:
    """The template (this tree, committed as v1.0.0; then v1.1.0) and the projects made from v1.0.0."""
    template = root / "template"
    listed = sh(ROOT, "git", "ls-files", "--cached", "--others", "--exclude-standard", "-z").stdout
    for path in listed.split("\0")[:-1]:
        if (ROOT / path).is_file():
            (template / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / path, template / path)
    sh(template, "git", "init", "-q")
    commits = {"v1.0.0": commit(template, "template", tag="v1.0.0")}
    init = template / "engine/src/scaleup/__init__.py"
    init.write_text(re.sub(r'__version__ = "[^"]*"', f'__version__ = "{NEXT_VERSION}"', init.read_text()))
    for path in (ENGINE_FIX, SKELETON_FIX):
        (template / path).write_text((template / path).read_text() + FIX)
    commits["v1.1.0"] = commit(template, "Next version", tag="v1.1.0")
    # Packed, as a template cloned from a server is: copier renders the path of every file in its checkout of the
    # template, .git's included, before it excludes any, and loose objects made that 60% of the paths it renders.
    sh(template, "git", "gc", "-q")
    (root / "commits.json").write_text(json.dumps(commits))
    for name in NAMES:  # a relative template path, as typed: stored absolute
        sh(root, sys.executable, "-m", "copier", "copy", "--trust", "--defaults", "--vcs-ref", "v1.0.0",
           "-d", f"project_name={name}", "-d", "author=A. User", template.name, name)  # fmt: skip
        sh(root / name, "git", "init", "-q")
        commit(root / name, "Start from the template")


@pytest.fixture(scope="session")
def made(tmp_path_factory) -> Path:
    """The template and the projects made from it, once per session: read them, change only clones."""
    return made_once(tmp_path_factory, "copier", make_template_and_projects)


def commits(made: Path) -> dict[str, str]:
    return json.loads((made / "commits.json").read_text())


def pin(made: Path, tag: str) -> str:
    return f"git+file://localhost{made / 'template'}@{commits(made)[tag]}#subdirectory=engine"


def venv_with(where: Path, *projects: Path) -> Path:
    """A fresh venv that sees this interpreter's packages (torch ...), with `projects` installed into it as the
    README installs them, from no index: the engine can only come from their pins. Returns its python.

    This interpreter's site-packages are listed in a .pth file of the new venv: venv's option to include the system
    site-packages would show the *base* interpreter's instead, which in a user's venv holds none of them (an old
    setuptools, no torch).
    Their .pth files are not run, so this checkout's editable engine stays out of sight."""
    venv = where / "venv"
    sh(where, sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    site_dirs = sh(where, python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip()
    Path(site_dirs, "outer-site-packages.pth").write_text("\n".join(dict.fromkeys(site.getsitepackages())) + "\n")
    editables = [arg for project in projects for arg in ("-e", f"{project}[test]")]
    sh(where, sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-index", "--no-build-isolation",
       *editables)  # fmt: skip
    return python


def imported(python: Path, cwd: Path, *modules: str) -> dict[str, str]:
    """Where each module imports from, and the engine's version, in `python` run from `cwd`."""
    names = ("scaleup", *modules)
    code = f"import json, {', '.join(names)}; print(json.dumps({{m: __import__(m).__file__ for m in {names}}}"
    code += " | {'version': scaleup.__version__}))"
    return json.loads(sh(cwd, python, "-c", code).stdout)


@pytest.fixture(scope="module")
def installed(made, tmp_path_factory) -> Iterator[tuple[Path, subprocess.Popen, Path]]:
    """Both projects installed in one fresh venv (its python), and the first one's own tests (the README's
    `pytest`) started there in the background, to be awaited by the last test of this file: the tests between
    run meanwhile."""
    where = tmp_path_factory.mktemp("installed")
    python = venv_with(where, *(made / name for name in NAMES))
    output = where / "pytest.out"
    with output.open("w") as out:
        # Its fast lane: the slow ones (a short run, the 2-process equivalence check) run on the same code in this
        # repository's tests/test_project.py; here the point is that they run from the pinned, installed engine.
        command = [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-m", "not slow"]
        tests = subprocess.Popen(command, cwd=made / NAMES[0], env=project_env(), stdout=out, stderr=out)
    yield python, tests, output
    tests.kill()
    tests.wait()


@pytest.mark.slow
def test_a_made_project_holds_its_own_code_and_pins_the_engine(made):
    project = made / "mynet"
    assert [entry for entry in TEMPLATE_ONLY if (project / entry).exists()] == []
    files = [path.relative_to(project) for path in project.rglob("*") if ".git" not in path.relative_to(project).parts]
    assert sorted(str(path) for path in files if path.name == "scaleup" or path.match("test_*.py")) == [
        "tests/test_data.py",
        "tests/test_project.py",
    ]  # no engine source and no engine tests, anywhere: its own data modules' tests and the contract's
    # Its Python outside its own package (entry points, tests, scripts/rename.py): well under 1,500 lines.
    outside = [path for path in files if path.suffix == ".py" and path.parts[0] != "src"]
    assert sum(len((project / path).read_text().splitlines()) for path in outside) < 1000
    assert sorted(p.name for p in (project / "src").iterdir()) == ["mynet"]
    assert "_target_: mynet.models.ImageClassifier" in (project / "configs/model/digits_cnn.yaml").read_text()
    pyproject = (project / "pyproject.toml").read_text()
    extras = ("", "[loggers]", "[shards]", "[slurm]", "[ray]", "[search]")
    pinned = [f'"scaleup-engine{extra} @ {pin(made, "v1.0.0")}"' for extra in extras]
    assert re.findall(r'"scaleup-engine[^"]*"', pyproject) == pinned
    # the template's own test paths and test helpers are not there
    assert [word for word in ('"engine/tests"', '"probes"', "template only") if word in pyproject] == []
    answers = (project / ".copier-answers.yml").read_text()
    assert "_commit: v1.0.0\n" in answers and f"_src_path: {made / 'template'}\n" in answers
    readme = (project / "README.md").read_text()
    assert readme.startswith("# mynet\n") and f"file://localhost{made / 'template'}/docs" in readme
    assert re.search(r"^Copyright \(c\) \d{4} A\. User$", (project / "LICENSE").read_text(), re.MULTILINE)


@pytest.mark.slow
def test_made_projects_install_from_their_pin_side_by_side(made, installed):
    """Both projects in one environment, each with its own package and the one engine, from the pin."""
    python, _, _ = installed
    (site,) = (python.parents[1] / "lib").glob("python*/site-packages")
    version = re.search(r'__version__ = "(.+)"', (ROOT / "engine/src/scaleup/__init__.py").read_text())[1]
    for project in (made / name for name in NAMES):
        assert imported(python, project, *NAMES) == {
            "scaleup": str(site / "scaleup/__init__.py"),  # built from the pinned commit, not this checkout
            **{name: str(made / name / "src" / name / "__init__.py") for name in NAMES},
            "version": version,  # this tree's, which v1.0.0 is
        }
    (source,) = site.glob("scaleup_engine-*.dist-info/direct_url.json")
    assert json.loads(source.read_text())["url"] == f"file://localhost{made / 'template'}"


@pytest.mark.slow
def test_copier_project_takes_the_next_version_and_keeps_old_checkpoints_and_shards(made, tmp_path):
    """The user's edits, then `copier update` to v1.1.0: the pin moves, the template's change to the project's files
    arrives, the user's edits stay, the new engine installs; a checkpoint and shards written by the template under
    its own name before all that still evaluate and train."""
    # Under the template's own name and engine (this checkout): shards, then a run on them.
    shards, trained = tmp_path / "shards", tmp_path / "trained"
    assert convert(["data=digits", f"out={shards}", "samples_per_shard=400", "workers=1"]) == 0
    common = ["data=sharded", f"data.url={shards}", "data.num_workers=0", "trainer.enable_progress_bar=false"]
    in_process([*common, "trainer.max_epochs=1", f"hydra.run.dir={trained}"])

    project = tmp_path / "mynet"
    sh(tmp_path, "git", "clone", "-q", made / "mynet", project)
    config = project / "configs/model/digits_cnn.yaml"
    config.write_text(config.read_text().replace("width: 32", "width: 24"))
    (project / "src/mynet/models/mlp.py").write_text('"""My MLP."""\n\nfrom torch import nn\n\nMLP = nn.Sequential\n')
    readme, pyproject = project / "README.md", project / "pyproject.toml"
    readme.write_text(readme.read_text() + "\n## My notes\n\nWidth 24 is enough.\n")
    pyproject.write_text(pyproject.read_text().replace('version = "0.1.0"', 'version = "0.4.2"'))
    commit(project, "My model")

    sh(project, sys.executable, "-m", "copier", "update", "--trust", "--defaults")
    assert sorted(sh(project, "git", "status", "--porcelain").stdout.splitlines()) == [
        " M .copier-answers.yml",
        f" M {SKELETON_FIX}",
        " M pyproject.toml",
    ]  # no conflict, no .rej file, nothing else touched
    assert "_commit: v1.1.0\n" in (project / ".copier-answers.yml").read_text()
    assert (project / SKELETON_FIX).read_text().endswith(FIX)
    assert (
        pyproject.read_text().count(pin(made, "v1.1.0")) == 6 and commits(made)["v1.0.0"] not in pyproject.read_text()
    )
    assert 'version = "0.4.2"' in pyproject.read_text()
    assert "width: 24" in config.read_text() and (project / "src/mynet/models/mlp.py").is_file()
    assert readme.read_text().endswith("\n## My notes\n\nWidth 24 is enough.\n")

    python = venv_with(tmp_path, project)
    found = imported(python, project)
    assert found["version"] == NEXT_VERSION
    assert Path(found["scaleup"]).parent.joinpath("plan/batch.py").read_text().endswith(FIX)

    # In the updated project, the template's checkpoint evaluates and resumes on the template's shards.
    best = next((trained / "checkpoints").glob("best-*.ckpt"))
    resumed = tmp_path / "resumed"
    # Side by side, each from its project: eval and resume in the updated one; a dry run in a project still pinned to
    # v1.0.0, run in this venv (whose engine is v1.1.0's), which must say so at start-up.
    commands = {
        "eval": (project, [python, "eval.py", f"ckpt_path={best}", f"hydra.run.dir={tmp_path / 'eval'}"]),
        "resume": (project, [python, "train.py", *common, f"ckpt_path={trained / 'checkpoints/last.ckpt'}",
                             "model.net.width=32", "trainer.max_epochs=2", f"hydra.run.dir={resumed}"]),
        "old_pin": (made / "mynet", [python, "train.py", "dry_run=true", f"hydra.run.dir={tmp_path / 'old_pin'}"]),
    }  # fmt: skip
    procs = {
        name: subprocess.Popen(
            command, cwd=cwd, env=project_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for name, (cwd, command) in commands.items()
    }
    outputs = {name: proc.communicate(timeout=300)[0] for name, proc in procs.items()}
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{outputs[name][-4000:]}"
    assert "pins the engine at commit" not in outputs["eval"]
    assert (
        f"this project pins the engine at commit {commits(made)['v1.0.0'][:12]}, but the engine installed here was "
        f"built from {commits(made)['v1.1.0'][:12]}"
    ) in outputs["old_pin"]
    trained_metrics = read_json(trained / "metrics.json")
    assert read_json(tmp_path / "eval/metrics.json")["test/acc"] == trained_metrics["test/acc"]
    assert read_json(resumed / "metrics.json")["test/samples"] == trained_metrics["test/samples"] == 360
    assert "_target_: mynet.models.ImageClassifier" in (resumed / "config.yaml").read_text()
    assert "resuming from" in (resumed / "train.log").read_text()


@pytest.mark.slow
def test_a_made_projects_own_tests_pass_where_it_is_installed(installed):
    """The project's own tests (`pytest -m "not slow"`), run by `installed` (in the background since it installed)."""
    _, tests, output = installed
    tests.wait(timeout=600)
    text = output.read_text()
    # its 20 fast tests (under xdist, the summary does not count the 4 deselected)
    assert tests.returncode == 0 and re.search(r"\b20 passed(, \d+ warnings)? in\b", text), text[-4000:]
