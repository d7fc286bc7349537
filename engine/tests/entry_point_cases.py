"""Run many entry-point commands in one interpreter: `python engine/tests/entry_point_cases.py CASES.json RESULTS.json`.

CASES.json is a list of `[script, [override, ...]]` (script: train.py, eval.py or export.py, in the repository
root). Each one runs as `python <script> <overrides>` would: the script itself, as `__main__`, with `sys.argv`
set, its stdout and stderr captured and its SystemExit caught. RESULTS.json gets a list of `{"rc", "stdout",
"stderr", "seconds"}` in the same order. One interpreter start (several seconds, most of it importing torch and
Lightning) serves every case, where a subprocess per case would pay it each time.
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from hydra.core.global_hydra import GlobalHydra

ROOT = Path(__file__).resolve().parents[2]  # the repository: the example project, with the engine in engine/


def run_case(script: str, overrides: list[str]) -> dict[str, Any]:
    """One command's exit code and output, as its own process would have them."""
    path = str(ROOT / script)
    stdout, stderr = io.StringIO(), io.StringIO()
    sys.argv = [path, *overrides]
    rc, started = 0, time.monotonic()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exit_:
            rc = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        except BaseException:  # what the interpreter would print before exiting with 1
            traceback.print_exc()
            rc = 1
        finally:
            GlobalHydra.instance().clear()  # each @hydra.main run initialises it anew
    seconds = time.monotonic() - started
    return {"rc": rc, "stdout": stdout.getvalue(), "stderr": stderr.getvalue(), "seconds": seconds}


if __name__ == "__main__":
    cases_file, results_file = sys.argv[1:3]
    cases = json.loads(Path(cases_file).read_text())
    results = [run_case(script, overrides) for script, overrides in cases]
    Path(results_file).write_text(json.dumps(results))
