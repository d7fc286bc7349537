"""Hyperparameter search: `python train.py hparams_search=<yours>` (docs/search.md).

An Optuna study in a database (SQLite in the sweep directory by default) drives Hydra's launcher: each trial is an
ordinary training run with its run directory, on as many devices as the command line gives it. The search resumes
after a crash with the same command; trials report `monitor.metric` each validation, for the pruner.
"""
