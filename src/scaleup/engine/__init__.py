"""The template's machinery: what makes 1 device and N devices train the same. You leave it alone.

The jobs (`train.py`, `eval.py`, `export.py`, `check_equivalence.py`) depend on your DataModule, LightningModule
and experiment config only through the contract in docs/contract.md.

- plan.py: the Plan record, the BatchNorm and SyncBN policy; topology.py: devices, nodes, accelerator, precision;
  batch.py: the global batch into devices x accumulation x micro-batch, steps per epoch.
- components.py: the run's data module and model, each told what it needs from the other; config.py.
- datamodule.py: `GlobalBatchDataModule`, the base class of every data set; samplers.py and permutation.py: the
  training order; batch_probe.py: the `auto` per-device batch.
- metrics.py: `StageMetrics`; seeding.py; checks.py: the pitfall checks; schema.py: every config value's type
  and range, checked before anything starts; errors.py: `UserError`, one message and exit code 2.
- launch.py: launchers, the run directory, the DDP strategy; trainer.py: the Trainer the jobs run, with the
  template's own callbacks; stop.py: SIGTERM stops every rank, exit code 143.
- checkpoint.py: safe, atomic, prefix-free checkpoint IO; resume.py: which checkpoint `ckpt_path` names, and
  whether it can continue under this plan; loggers.py.
- lightning_workarounds.py: every workaround of Lightning, each with its version, reason and canary test.
- callbacks/: LR schedule, diagnostics, pre-emption, run files, private metric states, EMA, TensorBoard's plan,
  the classifier's test-time figures, the throttled progress bar.
"""
