"""scaleup: train on one GPU or many, get the same model. The template's machinery: never renamed."""

__version__ = "0.3.0"  # the template version (copier tags it); your project's is in pyproject.toml
