"""This project's own tests: its code against the engine's contract, with the engine's checks (scaleup.testing).

Point them at your task (`experiment=...`) as you make it yours. Under a minute on 2 CPU cores (about 30 s).
"""

from pathlib import Path

import pytest

from scaleup.testing import check_contract, check_equivalence, train_eval_resume

PROJECT = Path(__file__).resolve().parents[1]  # the folder of train.py and configs/, wherever pytest runs from


@pytest.mark.parametrize("task", [[], ["experiment=char_lm"]], ids=["digits", "char_lm"])
def test_the_task_keeps_the_contract(task):
    check_contract(task, project=PROJECT)


@pytest.mark.slow  # an end-to-end run
def test_a_short_run_evaluates_exports_and_resumes_to_the_same_weights(tmp_path):
    train_eval_resume(tmp_path, ["trainer.max_epochs=2"], project=PROJECT)


@pytest.mark.slow  # 2 processes; `pytest -m "not slow"` leaves it out
def test_the_model_trains_the_same_on_1_and_2_processes():
    """With its randomness on (dropout, augmentation): 2 processes equal 1 accumulating 2, bit for bit in float64."""
    verdict = check_equivalence(["model.net.dropout=0.5", "data.augment=true"], project=PROJECT)
    assert "2 processes vs 1 accumulating 2: largest relative difference 0.00e+00" in verdict
