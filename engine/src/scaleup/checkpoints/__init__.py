"""Checkpoints: safe, atomic, prefix-free IO (io.py), sharded directories (sharded.py) written at once or in the
background (background.py), and resuming (resume.py)."""
