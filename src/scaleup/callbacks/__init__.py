from scaleup.callbacks.diagnostics import TrainingDiagnostics
from scaleup.callbacks.lr_scaling import LRScaling
from scaleup.callbacks.preemption import PreemptionCheckpoint
from scaleup.callbacks.run_files import ConfigInCheckpoint, MetricsFile

__all__ = ["ConfigInCheckpoint", "LRScaling", "MetricsFile", "PreemptionCheckpoint", "TrainingDiagnostics"]
