"""The project's form: your package imports the public API only, the machinery never imports your package, imports
point one way (no cycle), and the training job reads as its story, each concern entered at most twice."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import yaml

from conftest import ROOT

SRC = ROOT / "src"  # the project's package
ENGINE_SRC = ROOT / "engine" / "src"
MACHINERY = "scaleup"
(USER,) = [p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()]
PUBLIC_API = "scaleup.api"


def source(package: str) -> Path:
    return ENGINE_SRC if package == MACHINERY else SRC


def module_name(path: Path, src: Path) -> str:
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache  # parsed once for all the tests here (about 1 s for the engine); they only read the trees
def modules(package: str) -> dict[str, ast.Module]:
    src = source(package)
    return {module_name(path, src): ast.parse(path.read_text()) for path in sorted((src / package).rglob("*.py"))}


def imported(tree: ast.AST, *, top_level_only: bool = False) -> set[str]:
    """The modules an AST imports (a `from package import name` counts as the module package.name if that is one)."""
    nodes = ast.iter_child_nodes(tree) if top_level_only else ast.walk(tree)
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_your_package_imports_only_the_public_api():
    private = {
        f"{name} imports {target}"
        for name, tree in modules(USER).items()
        for target in imported(tree)
        if target.split(".")[0] == MACHINERY and not target.startswith(PUBLIC_API)
    }
    assert not private, sorted(private)
    assert any(PUBLIC_API in imported(tree) for tree in modules(USER).values())


def test_your_code_and_top_configs_carry_no_engine_wiring():
    """Your package imports no pydantic (the engine checks your constructors' plain hints), and your top configs name
    neither the engine's config groups (its Hydra plugin puts them on the search path) nor your package (a
    checkpoint's stored targets are found from your model's and data's `_target_`s)."""
    assert not [name for name, tree in modules(USER).items() if "pydantic" in {t.split(".")[0] for t in imported(tree)}]
    for job in ("train", "eval", "export"):
        config = yaml.safe_load((ROOT / "configs" / f"{job}.yaml").read_text())
        assert "package" not in config and "searchpath" not in config.get("hydra", {}), job


def test_the_engines_suite_never_imports_the_example():
    """engine/tests/ trains a project of its own (engine/tests/project/): no test module, helper or config imports the
    example's package or names one of its targets, so a project that replaces its example breaks none of them."""
    tests = ROOT / "engine" / "tests"
    reaching = [
        str(path.relative_to(tests))
        for path in sorted([*tests.rglob("*.py"), *tests.rglob("*.yaml")])
        if reaches_the_example(path)
    ]
    assert not reaching, reaching


def reaches_the_example(path: Path) -> bool:
    """Whether the file names one of the example's targets (`<package>.<name>`) or, a Python file, imports its package.
    Only a file holding the package's name is parsed: one without it can do neither."""
    text = path.read_text()
    if USER not in text:
        return False
    return bool(re.search(rf"\b{USER}\.", text)) or (
        path.suffix == ".py" and any(t.split(".")[0] == USER for t in imported(ast.parse(text)))
    )


def test_the_machinery_never_imports_your_package():
    reaching = {f"{name} imports {t}" for name, tree in modules(MACHINERY).items() for t in imported(tree) if t == USER}
    reaching |= {
        f"{name} imports {t}"
        for name, tree in modules(MACHINERY).items()
        for t in imported(tree)
        if t.startswith(f"{USER}.")
    }
    assert not reaching, sorted(reaching)


def test_the_machinerys_imports_have_no_cycle():
    """Every import counts, those inside functions and under TYPE_CHECKING too: an import placed inside a function to
    get past a cycle still ties the two modules together."""
    trees = modules(MACHINERY)

    def owner(target: str) -> str | None:
        """The engine module `target` names, or the module holding it (`scaleup.errors.UserError`)."""
        while target and target not in trees:
            target = target.rpartition(".")[0]
        return target or None

    graph = {
        name: {owner(t) for t in imported(tree)} - {None, name} - {p for p in trees if name.startswith(f"{p}.")}
        for name, tree in trees.items()
    }
    # A package's __init__ that re-exported its modules would make each of them depend on the others through it.
    assert all(
        not deps for name, deps in graph.items() if name != MACHINERY and (ENGINE_SRC / name.replace(".", "/")).is_dir()
    )
    state: dict[str, str] = {}  # visiting | done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "visiting"
        for dep in sorted(graph[node]):
            if state.get(dep) == "visiting":
                cycles.append(" -> ".join([*path[path.index(dep) :], dep]))
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


# The engine's own config sections: read as the typed record's attributes (config/typed.py), never by key.
ENGINE_SECTIONS = ("trainer", "strategy", "lr_schedule", "monitor", "checkpoint", "performance", "loader", "batches")


def reads_by_key(node: ast.AST) -> str | None:
    """The key, where `node` reads the whole config (`config`, `cfg`) or one of the engine's sections (as an
    attribute, `config.trainer`, or a variable named for it, `trainer_cfg`) with a string: `x["key"]`, `x.get("key")`.
    The user's own sections (data, model, callbacks, logger) are the dicts their `_target_`s take."""
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
        target, key = node.value, node.slice
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        target, key = node.func.value, node.args[0]
    else:
        return None
    if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
        return None
    names = {"config", "cfg", "lr_cfg", *(f"{section}_cfg" for section in ENGINE_SECTIONS)}
    whole_or_named = isinstance(target, ast.Name) and target.id in names
    section = isinstance(target, ast.Attribute) and target.attr in ENGINE_SECTIONS
    return key.value if whole_or_named or section else None


def test_the_engine_reads_its_config_by_attribute_outside_the_config_package():
    """The config is checked and typed once (config/typed.py: TrainConfig); every other module reads attributes with
    types, so a key read in one place and defaulted in another cannot come back."""
    reads = [
        f"{name}:{node.lineno}: {ast.unparse(node)}"
        for name, tree in modules(MACHINERY).items()
        if not name.startswith(f"{MACHINERY}.config.")
        for node in ast.walk(tree)
        if reads_by_key(node)
    ]
    assert not reads, reads


# The extras (docs/architecture.md): what a run uses only when asked, by the modules that make each one.
EXTRAS = {
    "sharded data": ("data.shards", "data.sharded", "data.convert", "data.index"),
    "images": ("data.images", "data.image_batches"),
    "fsdp": (
        "distributed.fsdp",
        "distributed.meta_init",
        "checkpoints.background",
    ),
    "launchers": ("distributed.torchrun", "distributed.ray_train", "distributed.ray_worker"),
    "search": ("search",),
    "fine-tuning": ("finetune", "checkpoints.weights_file"),
    "watch": ("distributed.watchdog",),
    "diagnostics": (
        "callbacks.diagnostics",
        "observability.step_time",
        "observability.speedup",
        "observability.figures",
    ),
    "equivalence": ("check_equivalence",),
    "auto batch size": ("plan.batch_probe",),
    "ema": ("callbacks.ema",),
    "sweep check": ("config.sweep",),
    "project tests": ("testing",),
}


def extra_of(module: str) -> str | None:
    """The extra `module` (a name without the `scaleup.` prefix) belongs to, or None for the core."""
    return next(
        (name for name, parts in EXTRAS.items() if any(module == p or module.startswith(f"{p}.") for p in parts)),
        None,
    )


def test_the_core_imports_no_extra():
    """Every import counts (inside functions and under TYPE_CHECKING too): the core switches no extra on itself. An
    extra joins a run as a part the config names by `_target_`, or through the registry (scaleup/registry.py)."""
    trees = modules(MACHINERY)
    names = {name.removeprefix(f"{MACHINERY}.") for name in trees}
    for parts in EXTRAS.values():  # every extra names modules that exist
        assert all(part in names or any(n.startswith(f"{part}.") for n in names) for part in parts), parts
    found = set()
    for name, tree in trees.items():
        module = name.removeprefix(f"{MACHINERY}.")
        if name in (MACHINERY, PUBLIC_API) or extra_of(module) is not None:
            continue
        for target in imported(tree):
            extra = extra_of(target.removeprefix(f"{MACHINERY}.")) if target.startswith(f"{MACHINERY}.") else None
            if extra is not None:
                found.add((module, extra))
    assert not found


def test_the_public_api_is_the_surface_above_the_core_and_the_extras():
    """scaleup.api gathers, for your code, the core's names and the extras' (ImageDataModule, ClassificationFigures):
    it is neither, and no module of the engine imports it, so neither layer depends on the surface."""
    trees = modules(MACHINERY)
    assert not [name for name, tree in trees.items() if name != PUBLIC_API and PUBLIC_API in imported(tree)]


# The extras cut loose: engine/tests/test_removable_extras.py runs the engine with them deleted.
REMOVABLE = ("ema", "equivalence", "search", "project tests", "auto batch size", "watch")


def test_no_module_outside_a_removable_extra_imports_it():
    """Neither the core nor another extra imports a removable one (every import counts): what deleting them all at
    once, as test_removable_extras does, cannot tell apart."""
    found = set()
    for name, tree in modules(MACHINERY).items():
        here = extra_of(name.removeprefix(f"{MACHINERY}."))
        for target in imported(tree):
            extra = extra_of(target.removeprefix(f"{MACHINERY}.")) if target.startswith(f"{MACHINERY}.") else None
            if extra in REMOVABLE and extra != here:
                found.add((name, extra))
    assert not found
