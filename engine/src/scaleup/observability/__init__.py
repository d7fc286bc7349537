"""What a run shows: exact metrics, diagnostics (data wait, throughput, memory), HParams, figures, progress, loggers."""
