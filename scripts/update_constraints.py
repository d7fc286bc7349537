"""Raise constraints.txt to the newest releases pyproject.toml allows: `python scripts/update_constraints.py`.

1. `pip install -U -e ".[test]"` in this environment, without constraints: the newest versions within
   pyproject.toml's bounds (Lightning and torchmetrics stay below their next minor release).
2. The canaries first (engine/tests/test_lightning_workarounds.py, engine/tests/test_compat.py): a Lightning that
   changed what a workaround relies on fails there, with the workaround's name, before anything else runs.
3. constraints.txt: the exact version of every package the test install needs, as installed now.

Then run the whole suite (`pytest`), and commit constraints.txt with the tested range in CHANGELOG.md.
`--freeze-only` skips 1 and 2: it writes what this environment has.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
CANARIES = ["engine/tests/test_lightning_workarounds.py", "engine/tests/test_compat.py"]
HEADER = """\
# The exact versions the suite last passed on (scripts/update_constraints.py writes this file).
# Install with them: python -m pip install -c constraints.txt -e ".[test]"  (or ".[dev]")
"""


def project_name() -> str:
    for line in (ROOT / "pyproject.toml").read_text().splitlines():
        if line.startswith("name = "):
            return line.split('"')[1]
    raise SystemExit("pyproject.toml names no project")


def closure(name: str, extras: set[str]) -> dict[str, str]:
    """{package: installed version} for `name[extras]` and everything it needs, as installed here."""
    pinned: dict[str, str] = {}
    todo = [(name, frozenset(extras))]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        current, wanted = todo.pop()
        if (current, wanted) in seen:
            continue
        seen.add((current, wanted))
        try:
            dist = distribution(current)
        except PackageNotFoundError:
            continue  # a marker excluded it on this platform
        pinned[canonicalize_name(dist.metadata["Name"])] = dist.version
        for line in dist.requires or []:
            requirement = Requirement(line)
            environments = [{"extra": extra} for extra in wanted] or [{"extra": ""}]
            if requirement.marker is None or any(requirement.marker.evaluate(env) for env in environments):
                todo.append((requirement.name, frozenset(requirement.extras)))
    pinned.pop(canonicalize_name(name), None)  # the project itself is installed from the clone
    return pinned


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--freeze-only", action="store_true", help="write what is installed, upgrade nothing")
    args = parser.parse_args(argv)
    if not args.freeze_only:
        subprocess.run([sys.executable, "-m", "pip", "install", "-U", "-e", ".[test]"], cwd=ROOT, check=True)
        canaries = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-q", *CANARIES], cwd=ROOT)
        if canaries.returncode != 0:
            print("the canaries failed: a workaround needs attention (see its docstring); constraints.txt unchanged")
            return 1
    pins = closure(project_name(), {"test", "dev"})
    lines = [f"{name}=={version}" for name, version in sorted(pins.items())]
    (ROOT / "constraints.txt").write_text(HEADER + "\n".join(lines) + "\n")
    print(f"wrote constraints.txt: {len(lines)} packages; now run pytest, then commit it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
