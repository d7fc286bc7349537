"""Turn this clone into a project of your own name: `python scripts/rename.py NAME`.

Moves your package, src/<current name>/ (`myproject` in the template), to src/NAME/ and replaces the current name as
a whole word in every tracked text file: imports, `_target_` strings in configs, pyproject, README, tests, notebooks,
benchmarks, scripts. The template's own files are never touched: the engine (engine/, whose package `scaleup` keeps
its name in every project, so the template's next version still applies to it), the reference docs/, copier.yml,
project/ (what copier puts in a made project) and this script.
The UPPER and Capitalised spellings follow (OLD_SEED -> NAME_SEED, OldThing -> NameThing); a longer word that only
contains the name (e.g. "oldness") is left alone. Two files keep the old name on purpose: LICENSE keeps the original
copyright line (the MIT licence asks every copy to carry it) and gains one for NAME; CHANGELOG.md keeps its history
and gains a "Renamed" entry.

It runs only on a git work tree without uncommitted changes, so `git diff` shows the whole rename and
`git reset --hard` undoes it. The current name is read from the tree (the one package under src/ besides scaleup),
so a renamed project can be renamed again. Checkpoints and shards written before a rename still load after it:
nothing on disk is named after your package (docs/checkpoints.md).

`--template DIR --commit SHA --author NAME --operation copy|update` is how `copier copy` and `copier update` run
it (copier.yml): from the template checkout DIR at commit SHA, in the project copier has just rendered from it,
with no git needed. It puts the project's own files from DIR/project/ in place of the template's (README, CI),
renames what was rendered, moving it over what is already at src/NAME/ (copier then merges your own changes back
in), and pins the engine, which copier.yml leaves out of the project: every `scaleup-engine` requirement in
pyproject.toml becomes `scaleup-engine @ git+<template>@<SHA>#subdirectory=engine`, so an update moves the pin to
the new commit. Lines of pyproject.toml marked `# template only` (the engine's tests) are dropped. LICENSE gains
a line for NAME's author. The name is checked when the project is made, not on an update: the template's next
version may use the word, and an update never stops half-way for it. A relative template path in
.copier-answers.yml is stored absolute, so that later updates (and pip) find the template.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import keyword
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MACHINERY = "scaleup"  # the engine's package: never renamed, never edited
# The template's own, never edited by a rename: the engine, its reference docs, copier's settings, what copier puts in
# a made project (renamed there, by the copy), and this script (its TEMPLATE_NAME is the template's name)
TEMPLATE_OWN = ("engine", "docs", "project", "copier.yml", "scripts/rename.py")
TEMPLATE_NAME = "myproject"  # your package's name in the template itself
ANSWERS = ".copier-answers.yml"  # copier's record of the template's path and version, and the answers
KEEP_HISTORY = ("LICENSE", "CHANGELOG.md")  # edited by their own rules, never search-and-replaced
# Where an example name is not the project: prose, and the rename's own examples and tests.
NOT_CODE = (*KEEP_HISTORY, "scripts/rename.py", "engine/tests/test_rename.py", "engine/tests/test_copier.py")
PROJECT_FILES = "project"  # what a made project has in place of the template's own files (README, CI)
ENGINE = "engine"  # the engine's folder in the template: a made project pins it instead of holding it
# Marks a line of pyproject.toml that only the template needs (its engine's tests and helpers): a made project
# drops it
TEMPLATE_ONLY = "# template only"
# A quoted requirement on the engine in pyproject.toml, with its extras and any earlier pin
ENGINE_REQUIREMENT = re.compile(r'"scaleup-engine(\[[^\]"]*\])?(?:\s*@[^"]*)?"')


class RenameError(Exception):
    """A reason not to rename; printed as one line, exit code 2, nothing changed."""


def camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def name_pattern(name: str) -> re.Pattern[str]:
    """The name as a whole word in its three spellings: name, NAME, Name (also inside NameThing, name_thing)."""
    return re.compile(
        rf"(?<![A-Za-z0-9])(?P<lower>{re.escape(name)})(?![a-z0-9])"
        rf"|(?<![A-Za-z0-9])(?P<upper>{re.escape(name.upper())})(?![A-Za-z0-9])"
        rf"|(?P<camel>{re.escape(camel(name))})(?![a-z0-9])"
    )


def replace_name(text: str, old: str, new: str) -> tuple[str, int]:
    """`text` with every whole-word spelling of `old` replaced by the same spelling of `new`, and the count."""
    spelling = {"lower": new, "upper": new.upper(), "camel": camel(new)}
    return name_pattern(old).subn(lambda match: spelling[match.lastgroup], text)


def git(root: Path, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    except FileNotFoundError:
        raise RenameError("git is not installed; the rename needs git to show and undo its changes") from None


def tracked_files(root: Path) -> list[str]:
    return git(root, "ls-files", "-z").stdout.split("\0")[:-1]


def read_text(path: Path) -> str | None:
    """A file's text, or None for binary files and links."""
    if path.is_symlink() or not path.is_file():
        return None
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def current_name(root: Path) -> str:
    """Your package: the one under src/ that is not the machinery."""
    packages = sorted(
        init.parent.name for init in (root / "src").glob("*/__init__.py") if init.parent.name != MACHINERY
    )
    if len(packages) != 1:
        raise RenameError(
            f"expected exactly one package under {root / 'src'} besides {MACHINERY}/, found {packages or 'none'}"
        )
    return packages[0]


def is_template_own(path: str) -> bool:
    return Path(path).parts[0] in TEMPLATE_OWN or path in TEMPLATE_OWN


def rendered_files(root: Path, template: Path) -> list[str]:
    """The files copier rendered from the template checkout `template` into `root` (without the .jinja suffix),
    as the template names them: only these are renamed, never the rest of a project (a venv, data, outputs)."""
    listed = git(template, "ls-files", "-z")
    if listed.returncode == 0:
        paths = [path.removesuffix(".jinja") for path in listed.stdout.split("\0")[:-1]]
    else:  # a template folder outside git
        paths = [str(p.relative_to(template)).removesuffix(".jinja") for p in template.rglob("*") if p.is_file()]
    return sorted(path for path in paths if (root / path).is_file() and not path.startswith(".copier-answers"))


def check_name(name: str, old: str, root: Path, files: list[str]) -> None:
    """Refuse a name that is not a lowercase Python package name, or that would collide with something."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise RenameError(
            f"'{name}' is not a valid package name: use lowercase letters, digits and underscores, starting with a "
            "letter (e.g. my_project)"
        )
    if keyword.iskeyword(name):
        raise RenameError(f"'{name}' is a Python keyword and cannot be imported; choose another name")
    if name == old:
        raise RenameError(f"the project is already named '{name}'")
    if name == MACHINERY:
        raise RenameError(
            f"'{name}' is the template's machinery (src/{MACHINERY}/), which keeps its name; choose another"
        )
    if name in sys.stdlib_module_names:
        raise RenameError(f"'{name}' would shadow Python's standard library module '{name}'; choose another name")
    top_level = {Path(path).parts[0] for path in files}
    if clash := sorted(entry for entry in top_level if Path(entry).stem == name):
        raise RenameError(f"'{name}' is already used at the project root ({clash[0]}); choose another name")
    if (installed := importlib.util.find_spec(name)) is not None and not (root / "src" / name).is_dir():
        raise RenameError(
            f"'{name}' is already an installed module ({installed.origin or 'a namespace package'}); "
            "the two would shadow each other; choose another name"
        )
    # Once renamed, every whole-word occurrence of the name is taken to mean the project (a second rename replaces
    # them all), so the name must not already mean something else in the code and configs: "net" would break
    # `model.net`.
    word = name_pattern(name)
    for path in files:
        text = "" if path in NOT_CODE or path.endswith(".md") else read_text(root / path) or ""
        places = [path] if word.search(path) else []
        places += [
            f"{path}:{n}: {line.strip()[:60]}" for n, line in enumerate(text.splitlines(), 1) if word.search(line)
        ]
        if places:
            raise RenameError(
                f"'{name}' already appears as a word in the project ({places[0]}); choose a name that does not, so "
                "that every occurrence of it means the project"
            )


def check_clean(root: Path) -> None:
    status = git(root, "status", "--porcelain", "--", ".")
    if status.returncode != 0:
        raise RenameError(
            f"{root} is not a git work tree; run `git init && git add -A && git commit -m 'Start from the template'` "
            "first, so the rename can be reviewed with `git diff` and undone"
        )
    if status.stdout.strip():
        raise RenameError(
            "the work tree has uncommitted changes (see `git status`); commit them first, so the rename can be "
            "reviewed with `git diff` and undone with `git reset --hard` without losing them"
        )


def store_absolute_source(root: Path, template: Path) -> None:
    """copier records the template's path as typed, and a later `copier update` looks a relative one up from where
    it runs: record the absolute path instead. copier cloned a git template from that path, so the clone's origin
    is the path made absolute."""
    answers = root / ANSWERS
    text = answers.read_text(encoding="utf-8") if answers.is_file() else ""
    line = re.search(r"^_src_path: .*$", text, flags=re.MULTILINE)
    if line is None:
        return
    source = str(yaml.safe_load(line[0])["_src_path"])
    if ":" in source or source.startswith(("/", "~")):  # a URL, a shortcut (gh:owner/name) or an absolute path
        return
    origin = git(template, "config", "remote.origin.url")
    path = Path(origin.stdout.strip()) if (template / ".git").is_dir() and origin.returncode == 0 else template
    stored = yaml.safe_dump({"_src_path": str(path.resolve())}, width=2**16).strip()
    answers.write_text(text[: line.start()] + stored + text[line.end() :], encoding="utf-8")


def render(root: Path, new: str, template: Path, author: str, update: bool, commit: str | None = None) -> list[str]:
    """Template mode (copier's task): make what copier rendered from `template` into `root` the project `new`:
    the project's own files from `template`/project/ in place of the template's, the name, the engine's pin."""
    store_absolute_source(root, template)
    written = put_project_files(root, template)
    changes = [f"wrote   {path} (the project's own, from {PROJECT_FILES}/)" for path in written]
    files = sorted({*rendered_files(root, template), *written})
    if new != TEMPLATE_NAME:
        if not update:  # checked when the project was made; the template's next version may use the word
            check_name(
                new,
                TEMPLATE_NAME,
                template,
                [path for path in files if not (root / path).is_relative_to(root / "src" / new)],
            )
        files = move_rendered(root, files, TEMPLATE_NAME, new)
        changes += rewrite_files(root, files, TEMPLATE_NAME, new, author)
    changes += drop_template_only(root)
    return [*changes, pin_engine(root, recorded_source(root) or str(template.resolve()), commit or head(template))]


def drop_template_only(root: Path) -> list[str]:
    """Remove the lines of pyproject.toml marked TEMPLATE_ONLY: the template's engine tests and their helpers, which
    a made project does not hold (an update drops them from both versions, so they never reach a merge)."""
    pyproject = root / "pyproject.toml"
    lines = pyproject.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if TEMPLATE_ONLY not in line]
    if len(kept) == len(lines):
        return []
    pyproject.write_text("".join(kept), encoding="utf-8")
    return [f"dropped {len(lines) - len(kept)} template-only line(s) from pyproject.toml"]


def put_project_files(root: Path, template: Path) -> list[str]:
    """Copy `template`/project/ over `root`: the files a made project has in place of the template's own (its
    README, its CI), which copier.yml keeps out of the copy. Returns their paths."""
    written = []
    for source in sorted((template / PROJECT_FILES).rglob("*")):
        if source.is_file():
            path = source.relative_to(template / PROJECT_FILES)
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / path)
            written.append(path.as_posix())
    return written


def recorded_source(root: Path) -> str | None:
    """The template's source as .copier-answers.yml records it (a path, a URL or a gh:/gl: shortcut), or None."""
    answers = root / ANSWERS
    return yaml.safe_load(answers.read_text(encoding="utf-8")).get("_src_path") if answers.is_file() else None


def head(template: Path) -> str | None:
    """The commit `template` has checked out, or None outside git."""
    found = git(template, "rev-parse", "HEAD")
    return found.stdout.strip() if found.returncode == 0 else None


def git_url(source: str) -> str:
    """The template's source as a URL git and pip clone: gh:owner/name and gl:owner/name as https, git@host:path
    as ssh://, a local path as file://localhost/<path> (pip before 24 refuses a dependency on `git+file:///<path>`,
    a URL without a host), any other URL as it is."""
    for shortcut, host in (("gh:", "https://github.com/"), ("gl:", "https://gitlab.com/")):
        if source.startswith(shortcut):
            return f"{host}{source.removeprefix(shortcut).removesuffix('.git')}.git"
    source = source.removeprefix("git+")
    if re.match(r"[a-z][a-z0-9+.-]*://", source):
        return source
    if scp := re.fullmatch(r"([^@/:]+@[^:/]+):(.+)", source):
        return f"ssh://{scp[1]}/{scp[2]}"
    return "file://localhost" + Path(source).expanduser().resolve().as_uri().removeprefix("file://")


def pin_engine(root: Path, source: str, commit: str | None) -> str:
    """Pin every `scaleup-engine` requirement in pyproject.toml (with its extras) to the engine of the template's
    `commit`, as a direct reference pip installs from git: `scaleup-engine @ git+<source>@<commit>#subdirectory=
    engine`. An earlier pin moves. README.md's ENGINE_DOCS becomes the engine's documentation at that commit."""
    if commit is None:
        return "left    pyproject.toml's scaleup-engine unpinned: the template is not a git repository"
    url = git_url(source)
    pyproject = root / "pyproject.toml"
    reference = f"git+{url}@{commit}#subdirectory={ENGINE}"
    text = pyproject.read_text(encoding="utf-8")
    pinned, count = ENGINE_REQUIREMENT.subn(lambda match: f'"scaleup-engine{match[1] or ""} @ {reference}"', text)
    pyproject.write_text(pinned, encoding="utf-8")
    readme = root / "README.md"
    if readme.is_file():
        docs = f"{url.removesuffix('.git')}/tree/{commit}/docs" if url.startswith("https://") else f"{url}/docs"
        readme.write_text(readme.read_text(encoding="utf-8").replace("ENGINE_DOCS", docs), encoding="utf-8")
    return f"pinned  {count} scaleup-engine requirement(s) in pyproject.toml to {reference}"


def move_paths(root: Path, old: str, new: str) -> list[str]:
    """`git mv` every path component that is the old name (src/old -> src/new), outermost first, outside the
    template's own files."""
    moves = []
    while True:
        for path in (path for path in tracked_files(root) if not is_template_own(path)):
            parts = Path(path).parts
            hit = next((i for i, part in enumerate(parts) if replace_name(part, old, new)[1]), None)
            if hit is not None:
                source = Path(*parts[: hit + 1])
                target = source.with_name(replace_name(parts[hit], old, new)[0])
                if (root / target).exists():
                    raise RenameError(f"cannot move {source} to {target}: {target} exists")
                moved = git(root, "mv", str(source), str(target))
                if moved.returncode != 0:
                    raise RenameError(f"git mv {source} {target} failed: {moved.stderr.strip()}")
                moves.append(f"moved   {source} -> {target}")
                break
        else:
            return moves


def move_rendered(root: Path, files: list[str], old: str, new: str) -> list[str]:
    """Template mode: move each rendered file under src/old/ to src/new/, over what is there; returns the new list."""
    moved = []
    for path in files:
        renamed, count = replace_name(path, old, new)
        if count:
            (root / renamed).parent.mkdir(parents=True, exist_ok=True)
            os.replace(root / path, root / renamed)
        moved.append(renamed)
    for folder in sorted((root / "src" / old).glob("**/"), key=lambda p: -len(p.parts)):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
    return moved


def add_license_line(text: str, new: str, author: str | None = None) -> str:
    """Keep the original copyright line (the licence requires it) and put the new project's line above it."""
    line = f"Copyright (c) {datetime.date.today().year} {author or f'The {new} authors'}"
    if line in text:
        return text
    return re.sub(r"^(?=Copyright)", line + "\n", text, count=1, flags=re.MULTILINE)


def add_changelog_entry(text: str, old: str, new: str) -> str:
    """Record the rename under Unreleased / Changed; the released history keeps the name it was released under."""
    entry = f"- Renamed the project from `{old}` to `{new}` (`python scripts/rename.py {new}`).\n"
    unreleased = re.search(r"^## \[Unreleased\].*\n", text, flags=re.MULTILINE)
    if unreleased is None:  # no Unreleased section: start one above the first release
        first = re.search(r"^## ", text, flags=re.MULTILINE)
        at = first.start() if first else len(text)
        return text[:at] + f"## [Unreleased]\n\n### Changed\n{entry}\n" + text[at:]
    section_end = re.compile(r"^## ", flags=re.MULTILINE).search(text, unreleased.end())
    end = section_end.start() if section_end else len(text)
    changed = re.compile(r"^### Changed\n", flags=re.MULTILINE).search(text, unreleased.end(), end)
    if changed:
        return text[: changed.end()] + entry + text[changed.end() :]
    return text[: unreleased.end()] + f"\n### Changed\n{entry}" + text[unreleased.end() :]


def rewrite_files(root: Path, files: list[str], old: str, new: str, author: str | None = None) -> list[str]:
    changes = []
    for path in files:
        file = root / path
        text = read_text(file)
        if text is None or is_template_own(path):
            continue
        if path == "LICENSE":
            updated, count = add_license_line(text, new, author), 1
        elif path == "CHANGELOG.md":
            if author is not None:  # a copier project keeps the template's changelog: what each update changes
                continue
            updated, count = add_changelog_entry(text, old, new), 1
        else:
            updated, count = replace_name(text, old, new)
        if updated != text:
            file.write_text(updated, encoding="utf-8")
            what = "kept the old name, added a line" if path in KEEP_HISTORY else f"{count} replacement(s)"
            changes.append(f"edited  {path} ({what})")
    return changes


def leftovers(root: Path, old: str) -> list[str]:
    """Spellings the rules do not cover (e.g. 'OldName' for old_name): reported for a look by hand."""
    found = []
    for path in tracked_files(root):
        text = "" if path in KEEP_HISTORY or is_template_own(path) else read_text(root / path) or ""
        found += [
            f"{path}:{number}: {line.strip()[:80]}"
            for number, line in enumerate(text.splitlines(), 1)
            if old.replace("_", "") in line.lower().replace("_", "")
        ]
    return found


def rename(root: Path, new: str) -> list[str]:
    """Check, then rename the project at `root` to `new`; returns what changed, one line each."""
    old = current_name(root)
    files = tracked_files(root)
    check_name(new, old, root, files)
    check_clean(root)
    changes = move_paths(root, old, new) + rewrite_files(root, tracked_files(root), old, new)
    stale = root / "src" / f"{old}.egg-info"  # build metadata of the old name; pip writes the new one
    if stale.is_dir():
        shutil.rmtree(stale)
        changes.append(f"removed src/{old}.egg-info (regenerated by pip install)")
    return changes


def main(argv: list[str] | None = None, root: Path | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="the new package name, e.g. my_project")
    parser.add_argument("--template", type=Path, help="copier's task: the template checkout the files came from")
    parser.add_argument("--author", default="", help="with --template: the copyright holder LICENSE names")
    parser.add_argument("--operation", choices=("copy", "update"), default="copy", help="with --template: copier's")
    parser.add_argument("--commit", help="with --template: the template's commit, which the engine is pinned to")
    args = parser.parse_args(argv)
    update = args.operation == "update"
    commit = args.commit if args.commit and args.commit != "None" else None  # copier renders a missing hash "None"
    try:
        if args.template is not None:
            # copier runs this file from the template, in the project it renders
            root = root or Path.cwd()
            author = args.author or f"The {args.name} authors"
            *changes, pin = render(root, args.name, args.template, author, update, commit)
            # An update also renders the old and the new version in copier's scratch folders, outside git: only the
            # project itself (a git work tree, which copier updates only) reports, so nothing is said of an update
            # that then stops (copier without a terminal asks for --defaults).
            if not update or git(root, "rev-parse", "--is-inside-work-tree").returncode == 0:
                print(f"renamed {TEMPLATE_NAME} -> {args.name}: {len(changes)} file(s)", pin.strip(), sep="\n")
            return 0
        root = root or ROOT
        old = current_name(root)
        changes = rename(root, args.name)
    except (RenameError, OSError) as error:
        # In an update copier may have written the new version over the project already: say how to get the
        # committed one back (copier updates only a tree with nothing uncommitted, so this loses nothing).
        restore = "; the update stopped part-way: `git reset --hard && git clean -fd` restores the project"
        print(f"error: {error}{restore if update else ''}", file=sys.stderr)
        return 2
    new = args.name
    print(f"renamed {old} -> {new}:", *(f"  {change}" for change in changes), sep="\n")
    if stale := leftovers(root, old):
        print("left as they are (check by hand):", *(f"  {line}" for line in stale), sep="\n")
    uninstall = [f"  pip uninstall -y {old}                 # the old name is installed here"]
    engine = '-e "./engine[test]" ' if (root / ENGINE).is_dir() else ""  # a clone of the template holds the engine
    print(
        "next steps:",
        *(uninstall if importlib.util.find_spec(old) else []),
        f'  python -m pip install -c constraints.txt {engine}-e ".[test]"',
        '  pytest -m "not slow"',
        "  ruff check --fix . && ruff format .   # import order and line wrapping may change with the name",
        f'  git add -A && git commit -m "Rename {old} to {new}"',
        "(before committing, `git diff --staged` and `git diff` show every change; `git reset --hard` undoes it)",
        sep="\n",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
