"""The template's machinery: what makes 1 device and N devices train the same. You leave it alone.

The jobs (`train.py`, `eval.py`, `export.py`) depend on your code only through this contract.

Data: `configs/data/<name>.yaml` builds a subclass of `scaleup.engine.datamodule.GlobalBatchDataModule`, which
- implements `build_splits()`: {"train", "val", "test"} map-style datasets, the same on every rank;
- passes `**loader_kwargs` (global_batch_size or per_device_batch_size, num_workers, seed, ...) to the base class;
- may implement `prepare_data()` (downloads, once per node) and `model_settings()`: what only the data knows,
  e.g. `{"net.num_classes": 10}`, written into the model config where it says `null`.
The base class gives the plan the split sizes, and the Trainer the loaders with world-size-invariant samplers.

Model: `configs/model/<name>.yaml` builds any LightningModule from its keys (`_target_` plus keyword arguments;
nested dicts such as `net` and `optimizer` arrive as plain dicts, so checkpoints load with `weights_only=True`).
- `configure_optimizers()` returns the optimizer(s), never an LR scheduler (refused at start-up). Each param
  group's LR is its base LR, valid at `callbacks.lr_scaling.base_batch_size`; `callbacks.lr_scaling` multiplies
  every group's LR by one factor per step (scaling for the global batch, warmup, decay), so ratios between groups
  hold. The job calls it once before training to plan, so keep it free of side effects.
- The loss is a mean over the device's batch: DDP averages gradients over devices, which is then the mean over
  the global batch (`python -m scaleup.check_equivalence` proves it for your module).
- Metrics are torchmetrics objects logged as `<stage>/<name>`, reduced once per epoch: `metrics.StageMetrics`
  wraps any Metric or MetricCollection per stage and adds `<stage>/loss` and `<stage>/samples`.
- `export.py` saves the state_dict of one submodule, `module=net` by default (`module=encoder` for another).

Task: `configs/experiment/<name>.yaml` picks the data and the model, and sets `monitor.metric` and `monitor.mode`
(the validation metric that picks the best checkpoint) and the `callbacks.lr_scaling` recipe:
`python train.py experiment=<name>`. `experiment=char_lm` (scaleup.data.text, scaleup.models.language_model) is
the worked example.

Here: plan.py (the Plan record, BatchNorm and SyncBN policy), topology.py (devices, nodes, accelerator,
precision), batch.py (global batch into devices x accumulation x micro-batch; steps per epoch), launch.py
(launchers, run directory, DDP strategy), checkpoint.py, seeding.py, samplers.py, datamodule.py, metrics.py,
checks.py (pitfall checks), config.py, errors.py (`UserError`: one message, exit code 2), batch_probe.py (the
`auto` per-device batch), loggers.py, callbacks/ (LR scaling and schedule, diagnostics, pre-emption, run files,
private metric states, EMA, TensorBoard's plan).
"""
