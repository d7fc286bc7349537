"""The template's own Lightning callbacks that belong to no one concern: the LR schedule, EMA, the run files
(metrics.json, the config inside each checkpoint), per-process metric states, speed settings."""
