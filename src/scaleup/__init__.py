"""scaleup: train on one GPU or many, get the same model."""

__version__ = "0.1.0"
