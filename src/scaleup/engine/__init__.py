"""The template's machinery: what makes 1 device and N devices train the same. You leave it alone.

The jobs (`train.py`, `eval.py`, `export.py`, `check_equivalence.py`) depend on your DataModule, LightningModule
and experiment config only through the contract in docs/contract.md.

Here: plan.py (the Plan record, BatchNorm and SyncBN policy), topology.py (devices, nodes, accelerator,
precision), batch.py (global batch into devices x accumulation x micro-batch; steps per epoch), components.py
(the run's data module and model, each told what it needs from the other), launch.py (launchers, run directory,
DDP strategy), checkpoint.py (safe, atomic, prefix-free IO), resume.py (which checkpoint `ckpt_path` names, and
whether it can continue under this plan), seeding.py, samplers.py, datamodule.py (`GlobalBatchDataModule`, the
base class of every data set), metrics.py (`StageMetrics`), checks.py (pitfall checks), config.py, errors.py
(`UserError`: one message, exit code 2), batch_probe.py (the `auto` per-device batch), loggers.py, trainer.py (the
Trainer the jobs run, with the template's own callbacks), callbacks/ (LR schedule, diagnostics, pre-emption, run
files, private metric states, EMA, TensorBoard's plan).
"""
