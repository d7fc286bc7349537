"""The config: every value's type and range (schema.py), and the Hydra tree as plain objects (plain.py)."""
