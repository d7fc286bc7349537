"""The plan: topology, the batch arithmetic, the LR plan, the start-up pitfall checks, the `auto` per-device batch."""
