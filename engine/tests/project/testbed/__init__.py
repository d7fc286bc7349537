"""The engine suite's own task: what its end-to-end tests train, evaluate, resume and shard.

The same interface as the example project's digits task (argument names, config keys, stored targets under `data.` and
`models.`), so that every override a test types is one a user types, and a checkpoint of either loads in the other;
written for the tests alone, so that a project that replaces its example never breaks the engine's suite.
"""
