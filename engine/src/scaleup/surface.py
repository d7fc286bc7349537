"""What the engine promises across minor versions, as plain data: `python -m scaleup.surface [--record]`.

Four parts, each read from the engine's source (parsed, never imported: no torch) and its configs:
- `api`: the names in `scaleup.api.__all__` that the module defines;
- `config`: every key of each option of the engine's config groups (conf/), at the place it lands, and every key of
  the project's composed train, eval and export configs, less the project's own `model` and `data` groups;
- `commands`: what the project's train.py, eval.py and export.py call in the engine, and the `python -m` commands
  with their own `key=value` options and flags;
- `formats`: what checkpoints and shards store that the engine reads back: the keys, version markers and names.

Semantic versioning, 0.x: the minor is the breaking digit. Within one (0.3.0, 0.3.1, ...) the surface may grow: a
new name, key, option or stored field. A removal, a rename (a removal and an addition) or a changed value (a format
marker, a config a command composes) needs the next minor, 0.4.0. `surface.json` beside this file records the
surface of the current minor; engine/tests/test_surface.py holds the engine to it.

    python -m scaleup.surface             # compare with the record: exit 0 if it holds, else 1 and what changed
    python -m scaleup.surface --record    # re-record (refused for a breaking change without a version bump)

Both run from the project's folder (train.py's), whose configs/ they compose.
"""

from __future__ import annotations

import ast
import functools
import json
import sys
from pathlib import Path
from typing import Any

import scaleup
from scaleup.conf import MADE, group_values
from scaleup.config.project import compose_project, project_configs
from scaleup.errors import UserError

PACKAGE = Path(__file__).resolve().parent  # engine/src/scaleup
RECORD = PACKAGE / "surface.json"
RECORD_COMMAND = "python -m scaleup.surface --record"
RECORD_NAME = "scaleup/surface.json"
JOBS = ("train", "eval", "export")  # the project's scripts <job>.py and the configs/<job>.yaml they compose
PROJECT_GROUPS = ("model", "data")  # groups of the project's own, not the engine's
# The `python -m` commands -> their own options. Where a module keeps them in an `OPTIONS` dict they are its keys;
# these modules parse theirs by hand, so they are named here and kept only while the module's source has them.
COMMANDS = {
    "scaleup.check_equivalence": ("--float32",),
    "scaleup.data.convert": "OPTIONS",
    "scaleup.data.index": ("fields",),
    "scaleup.distributed.ray_train": "OPTIONS",
}


@functools.cache
def _tree(module: str) -> ast.Module:
    """The parsed source of an engine module, e.g. `scaleup.data.convert`."""
    path = PACKAGE.parent.joinpath(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    return ast.parse(path.read_text())


def _assignments(body: list[ast.stmt]) -> dict[str, ast.expr]:
    """name -> value of the plain assignments in a body (`A = 1`, `A, B = 1, 2`, `A: int = 1`)."""
    values: dict[str, ast.expr] = {}
    for node in body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for target in targets:
            if isinstance(target, ast.Name) and node.value is not None:
                values[target.id] = node.value
            elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                values.update(
                    (t.id, v) for t, v in zip(target.elts, node.value.elts, strict=False) if isinstance(t, ast.Name)
                )
    return values


def _value(node: ast.expr, names: dict[str, ast.expr] | None = None) -> Any:
    """A literal as data: a dict with its keys and values, a set or `frozenset({...})` as a sorted list, a name
    bound to a literal in the module as its value, an f-string as its source; anything computed as None."""
    names = names or {}
    if isinstance(node, ast.Dict):
        return {
            ast.literal_eval(k): _value(v, names) for k, v in zip(node.keys, node.values, strict=True) if k is not None
        }
    if isinstance(node, ast.Call) and len(node.args) == 1 and getattr(node.func, "id", "") in ("frozenset", "set"):
        node = node.args[0]
    if isinstance(node, ast.Name) and node.id in names:
        return _value(names[node.id], names)
    if isinstance(node, ast.JoinedStr):
        return ast.unparse(node)
    try:
        value = ast.literal_eval(node)
    except ValueError:
        return None
    return sorted(value) if isinstance(value, (set, frozenset)) else value


def _binds(module: str, name: str) -> bool:
    """The module defines `name` at its top level: a function, class, assignment or import."""
    for node in _tree(module).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and name in {a.asname or a.name for a in node.names}:
            return True
    return name in _assignments(_tree(module).body)


def _find(module: str, kind: type, name: str) -> Any:
    """The class or function `name` in the module; None when it is gone (what it held then reads as removed)."""
    return next((n for n in ast.walk(_tree(module)) if isinstance(n, kind) and n.name == name), None)


def _assigned(module: str, target: str) -> Any:
    """The value assigned anywhere in the module to `target` (source text, e.g. `self._order`), as data."""
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Assign) and any(ast.unparse(t) == target for t in node.targets):
            return _value(node.value, _assignments(_tree(module).body))
    return None


def _returned(module: str, function: str) -> Any:
    """What a function returns, as data (a dict literal: its keys, and its values where they are constants)."""
    node = _find(module, ast.FunctionDef, function)
    returns = [n.value for n in ast.walk(node) if isinstance(n, ast.Return) and n.value] if node else []
    return _value(returns[0], _assignments(_tree(module).body)) if returns else None


def _constants(module: str, *names: str, cls: str | None = None) -> dict[str, Any]:
    """Module-level (or class-level) constants, as data; those no longer there are left out."""
    body = getattr(_find(module, ast.ClassDef, cls), "body", []) if cls else _tree(module).body
    values = _assignments(body)
    return {name: _value(values[name], _assignments(_tree(module).body)) for name in names if name in values}


def _keys_read(module: str, variable: str) -> list[str]:
    """The string keys the module reads from `variable`: `variable["key"]`, `variable.get("key")` and
    `f(variable, "key", ...)`."""
    keys = set()
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == variable:
            keys.add(node.slice)
        elif isinstance(node, ast.Call) and node.args:
            if ast.unparse(node.func) == f"{variable}.get":
                keys.add(node.args[0])
            elif ast.unparse(node.args[0]) == variable and len(node.args) > 1:
                keys.add(node.args[1])
    return sorted({k.value for k in keys if isinstance(k, ast.Constant) and isinstance(k.value, str)})


def _compared(module: str, function: str, variable: str) -> list[str]:
    """The strings `variable` is compared with (==, in) in a function: the cases it handles."""
    found = set()
    for node in ast.walk(_find(module, ast.FunctionDef, function) or ast.Module(body=[], type_ignores=[])):
        if isinstance(node, ast.Compare) and ast.unparse(node.left) == variable:
            found.update(c.value for c in node.comparators if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return sorted(found)


def api() -> list[str]:
    """`scaleup.api.__all__`, the names the module defines."""
    names = _value(_assignments(_tree("scaleup.api").body)["__all__"])
    return sorted(name for name in names if _binds("scaleup.api", name))


def _keys(tree: Any, prefix: str = "") -> list[str]:
    """Dotted keys of a config tree down to its leaves (an empty mapping is a leaf: a key one fills in)."""
    if not isinstance(tree, dict) or not tree:
        return [prefix] if prefix else []
    return [key for name, value in tree.items() for key in _keys(value, f"{prefix}{name}." if prefix else f"{name}.")]


def _leaf_keys(tree: Any) -> list[str]:
    return sorted(key.rstrip(".") for key in _keys(tree))


def option_keys(path: Path) -> dict[str, Any]:
    """The keys of the group option in the YAML file `path`, with those of the shared part (`_`-named, no option of
    its own) of the same group that its `defaults` list names: strategy/ddp starts from strategy/_base, and
    trainer/default from trainer/_lightning (made from code: scaleup.conf.MADE)."""
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    keys: dict[str, Any] = {}
    for entry in tree.pop("defaults", None) or []:
        if isinstance(entry, str) and entry.startswith("_") and entry != "_self_":
            part = path.with_name(f"{entry}.yaml")
            made = f"{path.parent.relative_to(PACKAGE / 'conf').as_posix()}/{entry}"
            keys |= group_values(made) if made in MADE else option_keys(part)
    return keys | tree


def config(configs: Path) -> dict[str, Any]:
    """`groups`: each option of the engine's groups (`strategy/fsdp`) -> its keys where they land (`strategy.*`, or
    anywhere for a `# @package _global_` file), with those of the shared part it starts from. `jobs`: each job -> the
    keys of the project's configs/<job>.yaml composed with its default choices (Hydra's own config and the project's
    groups left out: the engine's `hydra` group is among the groups)."""
    from omegaconf import OmegaConf

    conf, groups = PACKAGE / "conf", {}
    for path in sorted(path for path in conf.glob("**/*.yaml") if not path.stem.startswith("_")):
        group = path.parent.relative_to(conf).as_posix()
        tree = option_keys(path)
        if "# @package _global_" not in path.read_text():
            for part in reversed(group.split("/")):
                tree = {part: tree}
        groups[f"{group}/{path.stem}"] = _leaf_keys(tree)
    jobs = {}
    for job in JOBS:
        tree = OmegaConf.to_container(compose_project(job, configs=configs, hydra=False), resolve=False)
        for group in PROJECT_GROUPS if job == "train" else ():
            tree.pop(group, None)
        jobs[job] = _leaf_keys(tree)
    return {"groups": groups, "jobs": jobs}


def _calls(script: Path) -> dict[str, Any]:
    """A project script's engine names that the engine still defines, and the config it composes (`config_name`)."""
    tree = ast.parse(script.read_text())
    names = [
        f"{node.module}:{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "scaleup"
        for alias in node.names
    ]
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    config_names = [  # scaleup.entry.main(job, configs), or hydra.main(config_name=...)
        *(n.args[0] for n in calls if ast.unparse(n.func) == "main" and n.args),
        *(k.value for n in calls for k in n.keywords if k.arg == "config_name"),
    ]
    return {
        "calls": sorted(name for name in names if _binds(*name.split(":"))),
        "config": _value(config_names[0]) if config_names else None,
    }


def commands(project: Path) -> dict[str, Any]:
    """`python <job>.py` (the project's scripts: what they call in the engine) and each `python -m` command the
    engine runs, with its own options. A module that no longer runs as a command is left out."""
    found = {f"python {job}.py": _calls(project / f"{job}.py") for job in JOBS if (project / f"{job}.py").is_file()}
    for module, options in COMMANDS.items():
        try:
            tree = _tree(module)
        except FileNotFoundError:
            continue
        if "__name__ == '__main__'" not in {ast.unparse(n.test) for n in tree.body if isinstance(n, ast.If)}:
            continue
        if options == "OPTIONS":
            names = sorted((_constants(module, "OPTIONS").get("OPTIONS") or {}).keys())
        else:
            strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
            names = sorted(option for option in options if option in strings)
        found[f"python -m {module}"] = {"options": names}
    return found


def formats() -> dict[str, Any]:
    """What checkpoints and shards store that the engine reads back, from the code that writes or reads it."""
    plan_fields = getattr(_find("scaleup.plan.resolve", ast.ClassDef, "Plan"), "body", [])
    return {
        "checkpoint": {
            "scaleup": _assigned("scaleup.callbacks.run_files", "checkpoint['scaleup']"),  # config and plan
            "plan": sorted(n.target.id for n in plan_fields if isinstance(n, ast.AnnAssign)),
            "data_order": _assigned("scaleup.data.datamodule", "self._order"),  # the DataModule's state
            "sampler_order": _constants("scaleup.data.samplers", "ORDER", cls="GlobalBatchSampler").get("ORDER"),
            "shard_window_order": _assigned("scaleup.data.shards.order", "self.ORDER"),
            "sharded": _constants("scaleup.checkpoints.sharded", "METADATA", "SHARDS_METADATA", "PARTIAL", "OLD"),
        },
        "shards": {
            **_constants("scaleup.data.shards.format", "BLOCK", "KEY_DIGITS", "IMAGE_TYPES"),
            "fields": _compared("scaleup.data.shards.format", "decode_field", "kind"),
            **_constants("scaleup.data.shards.index", "INDEX", "FORMAT"),
            "index": _returned("scaleup.data.shards.index", "index_document"),  # index.json's document
            "shard_entry": _keys_read("scaleup.data.shards.index", "shard"),
        },
    }


def surface(configs: Path) -> dict[str, Any]:
    """The whole surface, as JSON-able data; `configs` is the project's configs/ (train.py's folder holds it)."""
    return {"api": api(), "config": config(configs), "commands": commands(configs.parent), "formats": formats()}


def differences(recorded: Any, current: Any, where: str = "surface") -> tuple[list[str], list[str]]:
    """(additions, breaking changes) from `recorded` to `current`, each a line naming the place. A list is a set and
    a mapping a set of keys: what is new is an addition, what is gone breaks; any other value that changed breaks."""
    if isinstance(recorded, dict) and isinstance(current, dict):
        added = [f"{where}: {key}" for key in current if key not in recorded]
        broken = [f"{where}: {key} removed" for key in recorded if key not in current]
        for key in recorded.keys() & current.keys():
            more, less = differences(recorded[key], current[key], f"{where}.{key}" if where != "surface" else key)
            added, broken = added + more, broken + less
        return sorted(added), sorted(broken)
    if isinstance(recorded, list) and isinstance(current, list):
        new = [f"{where}: {value}" for value in current if value not in recorded]
        return new, [f"{where}: {value} removed" for value in recorded if value not in current]
    if recorded != current:
        return [], [f"{where} changed: {json.dumps(recorded)} -> {json.dumps(current)}"]
    return [], []


def release(version: str) -> str:
    """`major.minor` of a version: what the record names."""
    return ".".join(version.split(".")[:2])


def next_breaking(version: str) -> str:
    """The version a breaking change takes: the next minor below 1.0 (0.3.1 -> 0.4.0), the next major from 1.0."""
    major, minor = (int(part) for part in version.split(".")[:2])
    return f"0.{minor + 1}.0" if major == 0 else f"{major + 1}.0.0"


def _listed(lines: list[str], most: int = 12) -> str:
    return "; ".join(lines[:most]) + (f"; ... ({len(lines)} in all)" if len(lines) > most else "")


def verdict(record: dict[str, Any], current: dict[str, Any], version: str) -> str | None:
    """None when `current` is the recorded surface of this version's minor; else one paragraph: what changed,
    whether a minor release may change it, and what to do."""
    added, broken = differences(record["surface"], current)
    if release(version) != record["version"]:
        return (
            f"scaleup.__version__ is {version} but {RECORD_NAME} records the surface of {record['version']}: re-record "
            f"it for {release(version)} with `{RECORD_COMMAND}` from the project's folder"
            + (f" (changed since: {_listed(broken + added)})" if broken or added else "")
        )
    if broken:
        return (
            f"The engine's surface changed within {record['version']} (scaleup.__version__ {version}): "
            + _listed(broken)
            + (f"; added: {_listed(added)}" if added else "")
            + f". A removal, a rename or a format change breaks what {record['version']} promises (additions are "
            f"allowed within a minor). Restore what was removed, or make it a new minor: set __version__ = "
            f'"{next_breaking(version)}" in engine/src/scaleup/__init__.py, say in the CHANGELOG what breaks, and '
            f"re-record with `{RECORD_COMMAND}` from the project's folder."
        )
    if added:
        return (
            f"The engine's surface grew within {record['version']}: {_listed(added)}. Additions are allowed within a "
            f"minor: record them (no version bump) with `{RECORD_COMMAND}` from the project's folder, so that "
            "removing them later is caught."
        )
    return None


def load(path: Path = RECORD) -> dict[str, Any]:
    return json.loads(path.read_text())


def record(current: dict[str, Any], version: str, path: Path = RECORD) -> str | None:
    """Write `current` as the surface of `version`'s minor; refused (the reason returned, nothing written) when it
    breaks the surface already recorded for that same minor."""
    if path.is_file():
        previous = load(path)
        if previous["version"] == release(version) and differences(previous["surface"], current)[1]:
            return verdict(previous, current, version)
    ordered = json.loads(json.dumps(current, sort_keys=True))  # stable diffs, whatever order the code finds things in
    path.write_text(json.dumps({"version": release(version), "surface": ordered}, indent=1) + "\n")
    return None


def main(argv: list[str]) -> int:
    """0: the surface holds (or was recorded), 1: it does not (or the record was refused), 2: not a project folder."""
    try:
        configs = project_configs()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    current = surface(configs)
    if "--record" in argv:
        problem = record(current, scaleup.__version__)
        print(problem or f"recorded the surface of {release(scaleup.__version__)} in {RECORD}")
    else:
        problem = verdict(load(), current, scaleup.__version__) if RECORD.is_file() else f"no {RECORD} yet"
        print(problem or f"the surface of {release(scaleup.__version__)} holds")
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
