"""Checkpoints: safe, atomic, prefix-free IO (io.py), sharded directories (sharded.py), and resuming (resume.py)."""
