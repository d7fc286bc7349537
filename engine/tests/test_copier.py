"""A project made with `copier copy`, then moved to the template's next version with `copier update`.

One story, as a user lives it: the template (this tree, as it is on disk, tagged twice) trains a checkpoint and
converts shards under its own package name; `copier copy` from a relative path makes the project `mynet`, the same
as a clone renamed by scripts/rename.py; the user edits a model config, adds a model and installs the project; the
template's next tag changes the machinery and an example, with the project's name in a comment; `copier update`,
run by the Python the project is installed in, brings both in, keeps the user's work, with no conflict; in the
updated project the old checkpoint evaluates, exports and resumes, the old shards train, and its own tests pass.
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, check, clean_env, in_process, read_json
from scaleup.data.convert import main as convert

pytest.importorskip("copier")

NAME = "mynet"
GIT = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
# The project's tests that touch its name everywhere: configs (every _target_), the contract, the plan.
# The rename's tests: every spelling of the name in a project named like the README's example.
PROJECT_TESTS = [
    "engine/tests/test_config.py",
    "engine/tests/test_contract.py",
    "engine/tests/test_plan.py",
    "engine/tests/test_rename.py",
]
MACHINERY_FIX = "engine/src/scaleup/plan/batch.py"  # what the template's next version changes in the machinery
EXAMPLE_FIX = "src/myproject/models/nets.py"  # ... and in the example code, which is the user's after the copy


# copier commits in its scratch repositories: a machine without a git identity must not fail them.
IDENTITY = {f"GIT_{who}_{what}": value for who in ("AUTHOR", "COMMITTER") for what, value in
            (("NAME", "test"), ("EMAIL", "test@example.com"))}  # fmt: skip


def sh(cwd: Path, *command: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**(env or os.environ), **IDENTITY}
    return check(subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True))


def commit(cwd: Path, message: str, tag: str | None = None) -> None:
    sh(cwd, *GIT, "add", "-A")
    sh(cwd, *GIT, "commit", "-q", "-m", message)
    if tag:
        sh(cwd, *GIT, "tag", tag)


def copy_tree(destination: Path) -> Path:
    """This tree as it is on disk (committed or not, less what git ignores), as a git repository of its own."""
    listed = sh(ROOT, "git", "ls-files", "--cached", "--others", "--exclude-standard", "-z").stdout
    for path in listed.split("\0")[:-1]:
        if (ROOT / path).is_file():
            (destination / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / path, destination / path)
    sh(destination, "git", "init", "-q")
    commit(destination, "template", tag="v1.0.0")
    return destination


def venv_with(project: Path, where: Path) -> Path:
    """A venv that sees this interpreter's packages, with `project` installed into it (editable, no deps): the
    project's own `scaleup` and `mynet`, never this checkout's."""
    venv = where / "venv"
    sh(where, sys.executable, "-m", "venv", "--without-pip", venv)
    (site_dir,) = (venv / "lib").glob("python*/site-packages")
    (site_dir / "outer-environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    python = venv / "bin" / "python"
    env = project_env()
    sh(where, python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", project, env=env)
    return python


def files(root: Path, leave_out: tuple[str, ...] = ()) -> dict[str, bytes]:
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in root.rglob("*")
        if path.is_file() and path.relative_to(root).parts[0] not in (".git", *leave_out)
    }


def project_env() -> dict[str, str]:
    env = clean_env()
    del env["PYTHONPATH"]  # this repository's engine/tests/ must not shadow the project's
    return env


@pytest.mark.slow
def test_copier_project_takes_the_next_version_and_keeps_old_checkpoints_and_shards(tmp_path):
    template = copy_tree(tmp_path / "template")
    # Under the template's own name: shards, then a run on them.
    shards, trained = tmp_path / "shards", tmp_path / "trained"
    assert convert(["data=digits", f"out={shards}", "samples_per_shard=400", "workers=1"]) == 0
    common = ["data=sharded", f"data.url={shards}", "data.num_workers=0", "trainer.enable_progress_bar=false"]
    in_process([*common, "trainer.max_epochs=1", f"hydra.run.dir={trained}"])

    project = tmp_path / NAME
    # A relative template path: stored absolute, so that the update, run from the project, finds the template.
    sh(tmp_path, sys.executable, "-m", "copier", "copy", "--trust", "--defaults", "-d", f"project_name={NAME}",
       "-d", "author=A. User", "--vcs-ref", "v1.0.0", template.name, NAME)  # fmt: skip
    assert f"_src_path: {template.resolve()}\n" in (project / ".copier-answers.yml").read_text()
    assert sorted(p.name for p in (project / "src").iterdir()) == [NAME, "scaleup"]
    assert filecmp.dircmp(template / "src/scaleup", project / "src/scaleup").diff_files == []  # never renamed
    assert "_target_: mynet.models.ImageClassifier" in (project / "configs/model/digits_cnn.yaml").read_text()
    assert re.search(r"^Copyright \(c\) \d{4} A\. User$", (project / "LICENSE").read_text(), re.MULTILINE)
    sh(project, "git", "init", "-q")
    commit(project, "Start from the template")
    # Without copier: a clone renamed to the README's example name is the same project.
    clone = tmp_path / "clone"
    sh(tmp_path, "git", "clone", "-q", template, clone)
    sh(clone, sys.executable, "scripts/rename.py", NAME)
    differ = ("LICENSE", "CHANGELOG.md", "copier.yml", ".copier-answers.yml", ".copier-answers.yml.jinja")
    assert files(clone, differ) == files(project, differ)

    # The user's own work: a changed model config, a model of their own.
    config = project / "configs/model/digits_cnn.yaml"
    config.write_text(config.read_text().replace("width: 32", "width: 24"))
    (project / f"src/{NAME}/models/mlp.py").write_text('"""My MLP."""\n\nfrom torch import nn\n\nMLP = nn.Sequential\n')
    commit(project, "My model")
    python = venv_with(project, tmp_path)  # the project installed, as the README's flow does
    env = project_env()
    # The template's next version: a machinery fix and an example fix that names the project in a comment.
    example_fix = f"# the example's fix; see also {NAME}\n"
    for path, line in [(MACHINERY_FIX, "# the machinery's fix\n"), (EXAMPLE_FIX, example_fix)]:
        (template / path).write_text((template / path).read_text() + line)
    commit(template, "Next version", tag="v1.1.0")

    sh(project, python, "-m", "copier", "update", "--trust", "--defaults", env=env)
    assert (project / MACHINERY_FIX).read_text().endswith("# the machinery's fix\n")
    assert (project / f"src/{NAME}/models/nets.py").read_text().endswith(example_fix)
    assert "width: 24" in config.read_text() and (project / f"src/{NAME}/models/mlp.py").is_file()
    assert "_commit: v1.1.0" in (project / ".copier-answers.yml").read_text()
    status = sh(project, "git", "status", "--porcelain").stdout.splitlines()
    assert sorted(status) == sorted(
        [" M .copier-answers.yml", f" M {MACHINERY_FIX}", f" M src/{NAME}/models/nets.py"]
    )  # no conflict, no .rej file, nothing else touched
    assert not (project / "src/myproject").exists()

    # The updated project: its tests, and the template's checkpoint and shards under the new name, side by side.
    best = next((trained / "checkpoints").glob("best-*.ckpt"))
    resumed, net = tmp_path / "resumed", tmp_path / "net.pt"
    commands = {
        "tests": [python, "-m", "pytest", *PROJECT_TESTS, "-m", "not slow", "-q", "-x", "-n", "0"],
        "eval": [python, "eval.py", f"ckpt_path={best}", f"hydra.run.dir={tmp_path / 'eval'}"],
        "export": [python, "export.py", f"ckpt_path={best}", f"output_path={net}"],
        "resume": [python, "train.py", *common, f"ckpt_path={trained / 'checkpoints/last.ckpt'}",
                   "model.net.width=32", "trainer.max_epochs=2", f"hydra.run.dir={resumed}"],
    }  # fmt: skip
    procs = {
        name: subprocess.Popen(
            command, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for name, command in commands.items()
    }
    outputs = {name: proc.communicate(timeout=300)[0] for name, proc in procs.items()}
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{outputs[name][-4000:]}"
    assert re.search(r"\d+ passed", outputs["tests"])
    trained_metrics = read_json(trained / "metrics.json")
    assert read_json(tmp_path / "eval/metrics.json")["test/acc"] == trained_metrics["test/acc"]
    assert torch.load(net, weights_only=True)  # a plain state_dict, not empty
    metrics = json.loads((resumed / "metrics.json").read_text())
    assert metrics["test/samples"] == trained_metrics["test/samples"] == 360
    assert "_target_: mynet.models.ImageClassifier" in (resumed / "config.yaml").read_text()
    assert "resuming from" in (resumed / "train.log").read_text()
