"""Everything that changes between one device and many: the plan, seeds, samplers' rank logic, checkpoints."""
