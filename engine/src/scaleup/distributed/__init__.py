"""Distributed: launchers and the run directory, clusters, FSDP2, and pre-emption (SIGTERM on any rank)."""
