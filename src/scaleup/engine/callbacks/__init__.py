from scaleup.engine.callbacks.diagnostics import TrainingDiagnostics
from scaleup.engine.callbacks.lr_scaling import LRScaling
from scaleup.engine.callbacks.metric_states import PrivateMetricStates
from scaleup.engine.callbacks.preemption import PreemptionCheckpoint
from scaleup.engine.callbacks.run_files import ConfigInCheckpoint, MetricsFile

__all__ = [
    "ConfigInCheckpoint",
    "LRScaling",
    "MetricsFile",
    "PreemptionCheckpoint",
    "PrivateMetricStates",
    "TrainingDiagnostics",
]
