"""This project's own tests: its code against the engine's contract, with the engine's checks (scaleup.testing).

Point them at your task (`experiment=...`) as you make it yours. About 35 s on 2 idle CPU cores.
"""

from pathlib import Path

import pytest

from scaleup.testing import check_contract, check_equivalence, train_eval_resume

PROJECT = Path(__file__).resolve().parents[1]  # the folder of train.py and configs/, wherever pytest runs from
# Each task with its randomness on (dropout, augmentation) and, for the language model, a network small enough for
# a test: what the checks run.
TASKS = {
    "digits": ["model.net.dropout=0.5", "data.augment=true"],
    "char_lm": ["experiment=char_lm", "model.net.width=32", "model.net.depth=1", "model.net.heads=2"],
}


@pytest.mark.parametrize("task", TASKS.values(), ids=TASKS.keys())
def test_the_task_keeps_the_contract(task):
    check_contract(task, project=PROJECT)


@pytest.mark.slow  # end-to-end runs
@pytest.mark.parametrize("task", TASKS.values(), ids=TASKS.keys())
def test_a_short_run_evaluates_exports_and_resumes_to_the_same_weights(task, tmp_path):
    train_eval_resume(tmp_path, [*task, "trainer.max_epochs=2"], project=PROJECT)


@pytest.mark.slow  # 2 processes; `pytest -m "not slow"` leaves it out
def test_the_model_trains_the_same_on_1_and_2_processes():
    """2 processes equal 1 accumulating 2, bit for bit in float64: the same micro-batches, the same random numbers.
    (About 20 s on 2 cores; run it for each task of yours that draws random numbers of its own.)"""
    verdict = check_equivalence(TASKS["digits"], project=PROJECT)
    assert "2 processes vs 1 accumulating 2: largest relative difference 0.00e+00" in verdict
