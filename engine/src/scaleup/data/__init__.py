"""Data order and loading: the base DataModules, samplers and the lazy permutation, per-sample seeding, image
decoding, and sharded data (shards/, the converter)."""
