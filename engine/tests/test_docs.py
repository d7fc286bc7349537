"""The documentation cannot go stale: every test, path, module, command and config key it cites exists.

Reads README.md, docs/*.md and benchmarks/README.md. Fast: no subprocess; Hydra composes the configs in this
process. A failure names the file, the line and the stale name.
"""

from __future__ import annotations

import ast
import functools
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import ENGINE_CONF, config_groups

ROOT = Path(__file__).resolve().parents[2]  # the repository: the example project, with the engine in engine/
CONFIGS = ROOT / "configs"  # the example project's, which the docs' commands run
EXAMPLE_GROUPS = (CONFIGS, ENGINE_CONF)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
# What a command runs -> the config it composes (check_equivalence passes its overrides to train.py).
JOBS = {"train.py": "train", "eval.py": "eval", "export.py": "export", "scaleup.check_equivalence": "train"}

TEST_CITE = re.compile(r"((?:engine/)?tests/\w+\.py)(?:::(\w+))?")
# A test named alone: `::test_x` after a cited file, or `test_a_b` (two underscores at least: `test_size` is a key).
BARE_TEST = re.compile(r"`(::)?(test_\w+_\w+|(?<=::)test_\w+)(?:\[[^\]`]*\])?`")
REPO_PATH = re.compile(r"(?<![\w./~-])((?:configs|src|benchmarks|scripts|docs|notebooks|tests|engine)/[\w./-]*)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
MODULE = re.compile(r"python -m (scaleup(?:\.\w+)+)")
CODE_SPAN = re.compile(r"`([^`]+)`")
# A value that stands for one: <run>, N, DIR, K|auto, ...
PLACEHOLDER = re.compile(r"[<>{}*|]|\.\.\.|^[A-Z_]+$")
# The first part of a dotted name in prose that makes it a config key ...
KEY_ROOTS = ("data", "loader", "model", "lr_schedule", "strategy", "callbacks", "logger", "debug", "monitor")
KEY_ROOTS += ("checkpoint", "performance", "paths")
# ... and of one that counts as a key only in `key=value`: Lightning's Trainer and Hydra have attributes too.
OBJECTS = ("trainer", "hydra")


@functools.cache
def lines(path: Path) -> list[tuple[int, str, bool]]:
    """(line number, text, inside a fenced code block) of a Markdown file; a fenced line ending in `\\` is joined
    with the next, and a table cell's escaped `\\|` read as `|`."""
    out, fenced, pending = [], False, None
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        text = raw.replace("\\|", "|")
        if text.lstrip().startswith("```"):
            fenced = not fenced
            continue
        pending = (pending[0], f"{pending[1]} {text.strip()}") if pending else (number, text)
        if fenced and pending[1].endswith("\\"):
            pending = (pending[0], pending[1][:-1])
            continue
        out.append((*pending, fenced))
        pending = None
    return out


def texts() -> Iterator[tuple[str, int, str, bool]]:
    """(file, line number, text, fenced) of every documentation line."""
    for path in DOCS:
        if path.exists():
            for number, text, fenced in lines(path):
                yield str(path.relative_to(ROOT)), number, text, fenced


@functools.cache
def known_tests() -> dict[str, set[str]]:
    """The test functions and methods of each file under engine/tests/ and tests/ (a parametrized test under its
    plain name)."""
    names = {}
    for path in sorted([*(ROOT / "engine" / "tests").glob("*.py"), *(ROOT / "tests").glob("*.py")]):
        names[str(path.relative_to(ROOT))] = {
            node.name
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_")
        }
    return names


def test_every_cited_test_exists():
    """`engine/tests/test_x.py::test_name`, `::test_name` (in the file cited before it on the line), `test_name`."""
    stale, every = [], set().union(*known_tests().values())
    for where, number, text, _ in texts():
        files = [(match.start(), match.group(1)) for match in TEST_CITE.finditer(text)]
        for match in TEST_CITE.finditer(text):
            file, name = match.groups()
            if file not in known_tests():
                stale.append(f"{where}:{number}: {file} does not exist")
            elif name and name not in known_tests()[file]:
                stale.append(f"{where}:{number}: {file}::{name} does not exist")
        for match in BARE_TEST.finditer(text):
            scoped, name = match.groups()
            file = next((f for start, f in reversed(files) if start < match.start()), None) if scoped else None
            if name not in (known_tests().get(file, set()) if file else every):
                stale.append(f"{where}:{number}: test {name} does not exist" + (f" in {file}" if file else ""))
    assert not stale, "\n".join(stale)


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_every_cited_path_and_link_exists():
    """Repository paths (`configs/...`, `src/...`, ...) and relative Markdown links, with their headings."""
    stale = []
    for where, number, text, _ in texts():
        for match in REPO_PATH.finditer(text):
            path = match.group(1).rstrip(".")
            if text[match.end() : match.end() + 1] in ("<", "{", "*", "|"):
                continue  # a pattern (configs/experiment/<name>.yaml), not a path
            if not (ROOT / path).exists():
                stale.append(f"{where}:{number}: {path} does not exist")
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # https://...
            file, _, anchor = target.partition("#")
            path = (ROOT / where).parent / file if file else ROOT / where
            if not path.exists():
                stale.append(f"{where}:{number}: link {target} leads nowhere")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                stale.append(f"{where}:{number}: link {target}: no such heading in {file or where}")
    assert not stale, "\n".join(stale)


def test_every_cited_module_exists():
    """`python -m scaleup.<module>`."""
    stale = []
    for where, number, text, _ in texts():
        for module in MODULE.findall(text):
            source = ROOT / "engine" / "src" / Path(*module.split("."))
            if not source.with_suffix(".py").exists() and not (source / "__main__.py").exists():
                stale.append(f"{where}:{number}: python -m {module}: no such module")
    assert not stale, "\n".join(stale)


@functools.cache
def groups() -> dict[str, frozenset[str]]:
    """Config group (a folder under configs/, e.g. model/optimizer) -> its options."""
    return {group: frozenset(path.stem for path in files) for group, files in config_groups(EXAMPLE_GROUPS).items()}


@functools.cache
def composed(job: str, choices: tuple[str, ...] = ()) -> dict[str, Any]:
    """configs/<job>.yaml composed with these group choices, Hydra's own config included, unresolved."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(job, overrides=list(choices), return_hydra_config=True)
    return OmegaConf.to_container(cfg, resolve=False)


@functools.cache
def every_train_key() -> tuple[dict[str, Any], ...]:
    """The composed train config, and each group option's own file under its key: a key named in prose exists
    under some choice of the groups (files of `# @package _global_` only set keys that exist elsewhere)."""
    trees = [composed("train")]
    for group in groups():
        for path in config_groups(EXAMPLE_GROUPS)[group]:
            if "@package _global_" not in path.read_text():
                tree = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
                for part in reversed(group.split("/")):
                    tree = {part: tree}
                trees.append(tree)
    return tuple(trees)


def has_key(tree: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return True


def split_override(token: str) -> tuple[str, str, str | None]:
    """(prefix `+`, `++`, `~` or "", key, value or None) of a Hydra override."""
    prefix = re.match(r"(\+\+|\+|~)?", token).group(0)
    key, equals, value = token[len(prefix) :].partition("=")
    return prefix, key, value if equals else None


def missing_options(group: str, value: str) -> list[str]:
    """The options named in `group=value` (one, a list, a sweep or a|b alternatives) that do not exist."""
    names = [name.strip() for name in re.split(r"[\[\],|]", value) if name.strip()]
    return [f"{group}={name}" for name in names if not PLACEHOLDER.search(name) and name not in groups()[group]]


def command_problems(job: str, args: list[str]) -> list[str]:
    """What a `python <job>.py args` command names that its composed config does not have."""
    overrides = [split_override(arg) for arg in args if ("=" in arg or arg.startswith("~")) and arg[0] != "-"]
    choices = []
    if job == "train":  # eval.py and export.py have no groups to choose
        picked = [(key, value) for _, key, value in overrides if key in groups() and value]
        if problems := [name for key, value in picked for name in missing_options(key, value)]:
            return problems
        for key, value in picked:
            first = value if value.startswith("[") else re.split(r"[,|]", value)[0]  # a sweep: its first job
            if not PLACEHOLDER.search(first):
                choices.append(f"{key}={first}")
    tree = composed(job, tuple(choices))
    return [
        key
        for prefix, key, _ in overrides
        if not prefix.startswith("+") and not (job == "train" and key in groups()) and not has_key(tree, key)
    ]


def commands(text: str) -> Iterator[tuple[str, list[str]]]:
    """(job, arguments) of each job command in a line: `python train.py ...`, `torchrun ... train.py ...`,
    `python -m scaleup.check_equivalence ...`."""
    for segment in re.split(r"&&|;|\|\|", text):
        try:
            tokens = shlex.split(segment, comments=True)
        except ValueError:  # an apostrophe in prose
            tokens = segment.split()
        for i, token in enumerate(tokens):
            script = token.endswith(".py") and JOBS.get(Path(token).name)
            module = i > 0 and tokens[i - 1] == "-m" and JOBS.get(token)
            if job := script or module:
                yield job, tokens[i + 1 :]
                break


def test_every_command_uses_existing_groups_and_keys():
    """Commands in code blocks, and in backticks in prose, against the config they compose: a group's option must
    exist, a key must exist once the command's own group choices are made (`+key` may be new)."""
    stale = []
    for where, number, text, fenced in texts():
        for span in [text] if fenced else CODE_SPAN.findall(text):
            for job, args in commands(span):
                for name in command_problems(job, args):
                    stale.append(f"{where}:{number}: `{name}` is not a key or group option of configs/{job}.yaml")
    assert not stale, "\n".join(stale)


def test_every_config_key_in_prose_exists():
    """`key=value` and dotted keys in backticks (`lr_schedule.rule=sqrt`, `monitor.metric`) exist under some
    choice of the groups, and the group options named (`data=cifar10`, `callbacks=[default,ema]`) exist."""
    stale = []
    for where, number, text, fenced in texts():
        if fenced:
            continue
        for span in CODE_SPAN.findall(text):
            if " " in span.strip() or next(commands(span), None):
                continue
            prefix, key, value = split_override(span.strip())
            root = key.split(".")[0]
            dotted_key = re.fullmatch(r"[a-z_]+(\.[a-z_0-9]+)+", key) and (
                root in KEY_ROOTS or (root in OBJECTS and value is not None)
            )
            if key in groups() and value is not None:
                stale += [f"{where}:{number}: `{name}` is not a group option" for name in missing_options(key, value)]
            elif dotted_key and not prefix and not any(has_key(tree, key) for tree in every_train_key()):
                stale.append(f"{where}:{number}: `{key}` is not a config key")
    assert not stale, "\n".join(stale)


def test_make_install_is_the_readmes_install_command():
    """`make install` installs at the versions the README's command pins (constraints.txt)."""
    recipe = re.search(r"^install:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)[1]
    assert f"`{recipe.replace('$(PYTHON)', 'python')}`" in (ROOT / "README.md").read_text()


def test_every_readme_section_cited_elsewhere_exists():
    """`(README, "Your project")` in a config, a docstring or a doc names a heading or a bold lead-in of README.md."""
    readme = (ROOT / "README.md").read_text()
    sections = set(re.findall(r"^#+ (.+)$", readme, re.MULTILINE)) | set(re.findall(r"\*\*([^*]+)\*\*", readme))
    cited = re.compile(r'README, "([^"]+)"(?:: \*\*([^*]+)\*\*)?')
    files = [*CONFIGS.rglob("*.yaml"), *(ROOT / "src").rglob("*.py"), *DOCS[1:], ROOT / "pyproject.toml"]
    stale = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in files
        for match in cited.finditer(path.read_text())
        for name in match.groups()
        if name is not None and name.rstrip(".,") not in sections
    ]
    assert stale == []


REFERENCE = ROOT / "docs" / "configuration.md"
# A reference table's row: `key`[, `key`...] | default[, default...] | ...; and in prose, `key` (default: ...) or
# `key` (default).
INLINE_DEFAULT = re.compile(r"`([a-z_]+(?:\.[a-z_0-9]+)+)` \((?:default:? )?`?(?!default)([\w.-]+)`?[):;,]")
LITERAL = re.compile(r"-?\d+(\.\d+)?|true|false|null|[a-z][\w-]*|\[[^\]]*\]")


def documented_defaults() -> Iterator[tuple[str, str, str]]:
    """(file:line, key, the default a doc states for it), where it states a literal: in docs/configuration.md's
    reference tables, and in the prose of every doc, `key` (default)."""
    for doc in DOCS:
        for number, text, fenced in lines(doc):
            if fenced:
                continue
            where = f"{doc.relative_to(ROOT)}:{number}"
            cells = [cell.strip() for cell in text.split("|")]
            if doc == REFERENCE and text.startswith("| `") and len(cells) > 3:
                keys = CODE_SPAN.findall(cells[1])
                values = re.split(r", | / ", cells[2].replace("`", ""))
                if len(keys) == len(values) and all("." in key for key in keys):
                    yield from ((where, key, value) for key, value in zip(keys, values, strict=True))
            yield from ((where, key, value) for key, value in INLINE_DEFAULT.findall(text))


def as_yaml(value: Any) -> str:
    """A composed value as the docs write it."""
    if isinstance(value, list):
        return "[" + ", ".join(map(as_yaml, value)) + "]"
    if value is None or isinstance(value, bool):
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)


def test_every_default_the_reference_states_is_the_configs():
    """A setting's default is defined once, in its config group's YAML: the defaults the docs state (the reference's
    tables, and `key` (default) in any doc) are checked against the composed config (the strategy keys against their
    option)."""
    wrong = []
    for where, key, stated in documented_defaults():
        if not LITERAL.fullmatch(stated):
            continue
        trees = [composed("train"), composed("train", ("strategy=fsdp",)), *every_train_key()]
        found = next((tree for tree in trees if has_key(tree, key)), None)
        if found is None:
            continue  # a key of a group option that is not composed by default: test_every_config_key_in_prose_exists
        value = found
        for part in key.split("."):
            value = value[part]
        if isinstance(value, str) and "${" in value:
            continue  # an interpolation: the docs say what it resolves to
        if as_yaml(value) != stated:
            wrong.append(f"{where}: `{key}` is {as_yaml(value)}, the docs say {stated}")
    assert not wrong, "\n".join(wrong)
