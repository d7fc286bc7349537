"""The notebooks run top to bottom on the bundled data, print what they promise and draw their figures."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import ROOT, clean_env

NOTEBOOKS = ROOT / "notebooks"


def execute(name: str, **env: str) -> tuple[str, int]:
    """Run a notebook in a fresh kernel started from notebooks/ (as Jupyter would); its text output and figure count.

    The kernel draws with matplotlib's inline backend: PNGs in the outputs, no display needed.
    """
    import nbformat  # here, not at the top: collecting the suite imports no Jupyter
    from nbclient import NotebookClient

    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), "outputs not stripped"
    client = NotebookClient(notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": NOTEBOOKS}})
    client.execute(env=clean_env(**env))
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    text = "".join(output.get("text", "") for output in outputs)
    figures = sum("image/png" in output.get("data", {}) for output in outputs)
    return text, figures


@pytest.mark.slow
def test_run_explorer_evaluates_the_checkpoint_on_cpu_as_the_run_did(trained_run: Path):
    text, figures = execute("run_explorer.ipynb", RUN_DIR=str(trained_run))
    assert figures == 2  # curves, confusion matrix
    assert "1 process(es); global batch 64 = 64 per device x 1 accumulation x 1" in text
    evaluated = re.search(r"test accuracy (\S+) on 360 samples \(the run reported (\S+) on 360\)", text)
    assert evaluated, text
    assert evaluated[1] == evaluated[2]  # same checkpoint, same batches, same CPU: the same predictions


@pytest.mark.slow
def test_plan_explorer_plans_the_recipe_for_1_8_32_and_256_gpus():
    text, figures = execute("plan_explorer.ipynb")
    assert figures == 1
    keep_global, keep_per_device = text.split("keep the per-device batch")
    rows = [line.split() for line in keep_global.splitlines() if re.match(r"\s*\d", line)]
    # GPUs, per-device batch, accumulation, global batch, peak LR, warmup steps, total steps
    assert rows == [
        ["1", "32", "256", "8192", "3.2", "780", "14040"],
        ["8", "32", "32", "8192", "3.2", "780", "14040"],
        ["32", "32", "8", "8192", "3.2", "780", "14040"],
        ["256", "32", "1", "8192", "3.2", "780", "14040"],
    ]
    rows = [line.split() for line in keep_per_device.splitlines() if re.match(r"\s*\d", line)]
    assert rows == [
        # at or below the base batch of 256 the LR has no peak to ramp to: no warmup
        ["1", "32", "1", "32", "0.0125", "0", str(90 * (1281167 // 32))],
        ["8", "32", "1", "256", "0.1", "0", str(90 * (1281167 // 256))],
        ["32", "32", "1", "1024", "0.4", str(5 * (1281167 // 1024)), str(90 * (1281167 // 1024))],
        ["256", "32", "1", "8192", "3.2", "780", "14040"],
    ]
